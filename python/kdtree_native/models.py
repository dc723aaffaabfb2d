"""The embedded default models shipped as package data (see docs/TRAINING.md).

* ``default_model_dir()``  the target: a ~13.6M-parameter DeepseekV3ForCausalLM (MLA + MoE).
* ``default_draft_dir()``  the draft: a ~1.6M-parameter DeepseekV3ForCausalLM, same vocabulary,
  distilled from the target.
* ``heldout_sample()``     a small sample of held-out text (never trained on), for tests and prompts.

Each model directory is a plain Hugging Face checkpoint directory: ``config.json``,
``generation_config.json``, ``model.safetensors`` (bf16; the routers' ``gate.weight`` and
``e_score_correction_bias`` in fp32) and the byte-level BPE tokenizer (``tokenizer.json`` plus
``tokenizer_config.json``/``special_tokens_map.json``), so ``AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained`` load it as is. Token ids: ``<|pad|>`` 0, ``<|bos|>`` 1,
``<|eos|>`` 2; the tokenizer prepends ``<|bos|>`` when adding special tokens, as in training.

This module imports nothing outside the standard library.
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["default_model_dir", "default_draft_dir", "heldout_sample", "DEFAULT_DATA_DIR"]

DEFAULT_DATA_DIR = Path(__file__).resolve().parent / "data" / "default"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


def _checked(sub: str) -> str:
    d = DEFAULT_DATA_DIR / sub
    missing = [f for f in _REQUIRED if not (d / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"kdtree_native: the embedded default {sub} model is missing {', '.join(missing)} in {d}. "
            "This install was built without its package data (kdtree_native/data/default/). Reinstall "
            "kdtree-native from a full source tree or wheel, or rebuild the models with tools/train/ "
            "(see docs/TRAINING.md)."
        )
    return str(d)


def default_model_dir() -> str:
    """Path of the shipped target checkpoint directory (HF format). Raises FileNotFoundError if absent."""
    return _checked("target")


def default_draft_dir() -> str:
    """Path of the shipped draft checkpoint directory (HF format). Raises FileNotFoundError if absent."""
    return _checked("draft")


def heldout_sample() -> list[dict]:
    """The held-out sample: a list of {"path": stdlib-relative path, "text": first ~1500 chars}."""
    p = DEFAULT_DATA_DIR / "heldout_sample.json"
    if not p.is_file():
        raise FileNotFoundError(f"kdtree_native: {p} is missing (package data not installed)")
    return json.loads(p.read_text())["files"]
