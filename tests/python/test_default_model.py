"""The embedded default models (docs/TRAINING.md): present, loadable as HF checkpoints, tokenizer
round-trips, and the held-out loss matches what docs/TRAINING.md records.

Cheap on purpose (< 20 s on 2 CPU cores): one [21, 64] forward per model.
"""
import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAINING_MD = ROOT / "docs" / "TRAINING.md"
TEST_TOKENS = 64  # keep equal to tools/train/evaluate.py TEST_TOKENS
TOL = 0.02


def _models_module():
    try:
        from kdtree_native import models

        return models
    except ImportError:  # native extension not built: the module itself is pure Python
        p = ROOT / "python" / "kdtree_native" / "models.py"
        spec = importlib.util.spec_from_file_location("_kn_models", p)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


models = _models_module()


def _documented_losses():
    text = TRAINING_MD.read_text()
    m = re.search(r"test-subset-loss:\s*target=([0-9.]+)\s+draft=([0-9.]+)", text)
    assert m, "docs/TRAINING.md lacks the 'test-subset-loss: target=X draft=Y' line"
    return {"target": float(m.group(1)), "draft": float(m.group(2))}


def test_dirs_exist_and_are_hf_checkpoints():
    for d in (models.default_model_dir(), models.default_draft_dir()):
        p = Path(d)
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (p / f).is_file(), p / f
        cfg = json.loads((p / "config.json").read_text())
        assert cfg["model_type"] == "deepseek_v3"
        assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
        assert cfg["vocab_size"] == 4096
    t = json.loads((Path(models.default_model_dir()) / "config.json").read_text())
    d = json.loads((Path(models.default_draft_dir()) / "config.json").read_text())
    assert t["vocab_size"] == d["vocab_size"]
    assert (Path(models.default_model_dir()) / "tokenizer.json").read_bytes() == (
        Path(models.default_draft_dir()) / "tokenizer.json"
    ).read_bytes()


def test_missing_dir_error(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "DEFAULT_DATA_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="missing"):
        models.default_model_dir()


def test_safetensors_layout():
    st = pytest.importorskip("safetensors")

    with st.safe_open(str(Path(models.default_model_dir()) / "model.safetensors"), "np") as f:
        keys = list(f.keys())
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in keys
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in keys


def test_tokenizer_roundtrip():
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(Path(models.default_model_dir()) / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in ("<|pad|>", "<|bos|>", "<|eos|>")] == [0, 1, 2]
    texts = [f["text"] for f in models.heldout_sample()[:5]] + [
        "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
        "unicode: héllo wörld — 日本語 🙂\ttabs\r\nand CRLF",
        "",
    ]
    for s in texts:
        enc = tok.encode(s)
        assert enc.ids[:1] == [1]  # <|bos|> prepended by default
        assert tok.decode(enc.ids, skip_special_tokens=True) == s
        assert tok.decode(tok.encode(s, add_special_tokens=False).ids) == s


@pytest.mark.hf
def test_hf_load_and_heldout_loss():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("transformers without DeepseekV3")
    import torch.nn.functional as F

    torch.manual_seed(0)
    expected = _documented_losses()
    sample = models.heldout_sample()
    for name, d in (("target", models.default_model_dir()), ("draft", models.default_draft_dir())):
        tok = transformers.AutoTokenizer.from_pretrained(d)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        model.eval()
        assert type(model).__name__ == "DeepseekV3ForCausalLM"
        rows = [tok(f["text"])["input_ids"][:TEST_TOKENS] for f in sample]
        assert all(len(r) == TEST_TOKENS and r[0] == 1 for r in rows)
        x = torch.tensor(rows)
        with torch.no_grad():
            logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
        loss = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)))
        assert abs(loss - expected[name]) < TOL, (name, loss, expected[name])
