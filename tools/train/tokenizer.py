"""Byte-level BPE tokenizer for the embedded default model, and the token arrays it trains on.

* Trained with HF ``tokenizers`` on the TRAINING split of ``corpus.py`` only (held-out files unseen).
* Vocabulary ``VOCAB_SIZE`` = 4096 including three special tokens, which get the first ids:
  ``<|pad|>`` = 0, ``<|bos|>`` = 1, ``<|eos|>`` = 2.
* GPT-2 style byte-level pre-tokenizer (no prefix space) and decoder: every string round-trips
  exactly (``decode(encode(s)) == s``).
* Post-processor prepends ``<|bos|>`` when ``add_special_tokens=True`` (the default of
  ``Tokenizer.encode`` and of HF ``tokenizer(text)``), which matches how documents start in training.
* Token stream: each file is ``<|bos|> file-tokens <|eos|>``, files concatenated in path order.

Outputs (into ``--out``, default ``.train_data``, which must stay git-ignored)::

    tokenizer.json, tokenizer_config.json, special_tokens_map.json  (HF fast tokenizer files)
    train.npy, heldout.npy   uint16 token ids of the two splits
    data.json                counts

Usage::

    python tools/train/tokenizer.py --out .train_data
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402

VOCAB_SIZE = 4096
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2


def train_tokenizer(texts, vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    return tok


def save_hf(tok, out: Path):
    """Write tokenizer.json plus the HF config files so AutoTokenizer.from_pretrained(out) works."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n"
    )


def encode_docs(tok, texts) -> np.ndarray:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    encs = tok.encode_batch(texts, add_special_tokens=False)
    parts = []
    for e in encs:
        parts.append(np.asarray([bos] + e.ids + [eos], dtype=np.uint16))
    return np.concatenate(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".train_data")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args(argv)
    out = Path(args.out)
    train, heldout = corpus.split_corpus()
    train_texts = [t for _, t in train]
    heldout_texts = [t for _, t in heldout]
    tok = train_tokenizer(train_texts, args.vocab_size)
    save_hf(tok, out)
    tr = encode_docs(tok, train_texts)
    ho = encode_docs(tok, heldout_texts)
    assert tok.get_vocab_size() <= 65535
    np.save(out / "train.npy", tr)
    np.save(out / "heldout.npy", ho)
    # Round-trip sanity on the held-out files.
    for t in heldout_texts[:5]:
        assert tok.decode(tok.encode(t).ids, skip_special_tokens=True) == t
    info = {
        "python": sys.version.split()[0],
        "vocab_size": tok.get_vocab_size(),
        "special_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
        "train_files": len(train_texts),
        "heldout_files": len(heldout_texts),
        "train_tokens": int(tr.size),
        "heldout_tokens": int(ho.size),
        "train_bytes_per_token": sum(len(t.encode()) for t in train_texts) / tr.size,
        "heldout_paths": [r for r, _ in heldout],
    }
    (out / "data.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps({k: v for k, v in info.items() if k != "heldout_paths"}, indent=1))


if __name__ == "__main__":
    main()
