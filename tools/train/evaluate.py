"""Evaluate shipped (or any) checkpoints on CPU: held-out sample loss, draft/target agreement, greedy text.

Held-out sample loss is the definition the test suite checks (tests/python/test_default_model.py):
for every file of ``heldout_sample.json``, tokenize its text with ``<|bos|>`` prepended (the
tokenizer's default), run the model in float32 (weights as stored, upcast), and average the
next-token cross-entropy over all predicted tokens of all files (a token-weighted mean).
The test suite checks the cheaper ``test_subset_loss`` (first 64 tokens of each file, one batch).

Usage::

    python tools/train/evaluate.py                       # the shipped target and draft
    python tools/train/evaluate.py --target DIR --draft DIR --gen-tokens 120
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "python" / "kdtree_native" / "data" / "default"
TEST_TOKENS = 64
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n\n\ndef read_config(path):"]


def load(d):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model.eval()
    return tok, model


def sample_ids(tok, sample):
    return [tok(f["text"])["input_ids"] for f in sample]


def sample_loss(model, ids_list):
    """Token-weighted mean next-token CE over the sample; also returns the per-position argmax."""
    import torch
    import torch.nn.functional as F

    tot, n, preds = 0.0, 0, []
    with torch.no_grad():
        for ids in ids_list:
            x = torch.tensor([ids])
            logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
            y = x[0, 1:]
            tot += float(F.cross_entropy(logits, y, reduction="sum"))
            n += y.numel()
            preds.append(logits.argmax(-1))
    return tot / n, n, preds


def test_subset_loss(model, tok, sample, n_tokens: int = TEST_TOKENS):
    """The number tests/python/test_default_model.py checks: one [files, n_tokens] batch made of the
    first n_tokens tokens (<|bos|> included) of every sample file; mean next-token CE, float32."""
    import torch
    import torch.nn.functional as F

    x = torch.tensor([tok(f["text"])["input_ids"][:n_tokens] for f in sample])
    with torch.no_grad():
        logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DATA / "target"))
    ap.add_argument("--draft", default=str(DATA / "draft"))
    ap.add_argument("--sample", default=str(DATA / "heldout_sample.json"))
    ap.add_argument("--gen-tokens", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    sample = json.loads(Path(args.sample).read_text())["files"]
    res = {}
    preds = {}
    for name, d in (("target", args.target), ("draft", args.draft)):
        if not d:
            continue
        tok, model = load(d)
        ids = sample_ids(tok, sample)
        t0 = time.perf_counter()
        loss, n, preds[name] = sample_loss(model, ids)
        res[name] = {"heldout_sample_loss": round(loss, 4), "tokens": n, "seconds": round(time.perf_counter() - t0, 2)}
        print(f"{name}: held-out sample loss {loss:.4f} over {n} tokens ({res[name]['seconds']} s)", flush=True)
        sub = test_subset_loss(model, tok, sample)
        res[name]["test_subset_loss"] = round(sub, 4)
        print(f"{name}: test-subset loss ({len(sample)} x {TEST_TOKENS} tokens) {sub:.4f}", flush=True)
        for p in PROMPTS:
            x = tok(p, return_tensors="pt")
            with torch.no_grad():
                y = model.generate(**x, max_new_tokens=args.gen_tokens, do_sample=False)
            text = tok.decode(y[0], skip_special_tokens=True)
            res[name].setdefault("greedy", {})[p] = text
            print(f"---- {name} greedy, prompt {p!r}\n{text}\n", flush=True)
    if "target" in preds and "draft" in preds:
        import torch

        a = torch.cat(preds["target"])
        b = torch.cat(preds["draft"])
        agree = float((a == b).float().mean())
        res["top1_agreement"] = round(agree, 4)
        print(f"draft/target top-1 agreement on the sample: {agree:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
