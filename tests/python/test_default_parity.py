"""The shipped default checkpoints (target and draft) through our engine == HF transformers.

Issue 7's parity requirement: the engine's greedy continuation of a code prompt on the shipped
bf16 checkpoint equals HF DeepseekV3ForCausalLM's (both run it in float32: bf16 -> f32 is exact),
and the prefill logits agree within the parity tolerance. Also checks that DDTree with the
shipped draft model gives the same tokens as AR.
"""
import numpy as np
import pytest

import kdtree_native as kn
from hf_models import hf_greedy, hf_logits, require_hf

PROMPT = "class Stack:\n    def __init__(self):"
N_NEW = 24


def _prompt_ids(model_dir):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(model_dir + "/tokenizer.json")
    return np.asarray(tok.encode(PROMPT).ids, dtype=np.int64)


@pytest.mark.parametrize("which", ["target", "draft"])
def test_shipped_model_matches_hf(which):
    require_hf()
    model_dir = kn.default_model_dir() if which == "target" else kn.default_draft_dir()
    ids = _prompt_ids(model_dir)
    eng = kn.Engine.from_pretrained(model_dir, device="cpu", max_seq_len=256)
    ours = eng.prefill(ids)
    ref = hf_logits(model_dir, ids)
    scale = float(np.abs(ref).max())
    assert ours.shape == ref.shape
    assert float(np.abs(ours - ref).max()) / scale < 1e-4
    res = eng.generate(ids, N_NEW)
    np.testing.assert_array_equal(res.tokens.astype(np.int64), hf_greedy(model_dir, ids, N_NEW))


def test_shipped_draft_ddtree_equals_ar():
    from kdtree_native.drafters import ModelDrafter

    ids = _prompt_ids(kn.default_model_dir())
    eng = kn.Engine.from_pretrained(kn.default_model_dir(), device="cpu", max_seq_len=256)
    draft = kn.Engine.from_pretrained(kn.default_draft_dir(), device="cpu", max_seq_len=256)
    ar = eng.generate(ids, 48)
    dd = eng.generate(ids, 48, drafter=ModelDrafter(draft), tree_budget=16, depth=6)
    np.testing.assert_array_equal(dd.tokens, ar.tokens)
    assert dd.stats["mean_acceptance_length"] > 1.0
