"""Corpus for the embedded default model: the Python standard library's own sources.

The text is on every machine with Python and needs no download. We take every ``.py`` file under
``sysconfig.get_paths()["stdlib"]`` of the interpreter that runs this script, skipping test suites
(any path component named ``test``, ``tests`` or ``idle_test``), ``site-packages``/``dist-packages``
and ``__pycache__``, and files that are not valid UTF-8.

The held-out split is by WHOLE files and deterministic: a file is held out when the first 8 hex
digits of ``sha256(relative_path)`` taken as an integer are ``< HELDOUT_PER_MILLE`` modulo 1000
(~3% of files). It depends only on the relative path, so the same file is held out on every
Python version that has it.

Usage (writes the split lists and a manifest; ``tokenizer.py`` makes the token arrays; ``--sample``
writes the small held-out sample shipped with the package for tests, prompts and benchmarks)::

    python tools/train/corpus.py --out .train_data \
        --sample python/kdtree_native/data/default/heldout_sample.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
HELDOUT_PER_MILLE = 30  # ~3% of files
SAMPLE_CHARS = 1500


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def is_heldout(rel_path: str) -> bool:
    h = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()
    return int(h[:8], 16) % 1000 < HELDOUT_PER_MILLE


def iter_files(root: Path | None = None):
    """Yield (relative posix path, text) for every corpus file, sorted by path."""
    root = root or stdlib_root()
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                paths.append(Path(dirpath) / name)
    for p in sorted(paths, key=lambda q: q.relative_to(root).as_posix()):
        rel = p.relative_to(root).as_posix()
        try:
            text = p.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = text.replace("\r\n", "\n")
        if not text.strip():
            continue
        yield rel, text


def split_corpus(root: Path | None = None):
    """Return (train, heldout): two lists of (rel_path, text)."""
    train, heldout = [], []
    for rel, text in iter_files(root):
        (heldout if is_heldout(rel) else train).append((rel, text))
    return train, heldout


def heldout_sample(heldout, max_chars: int = SAMPLE_CHARS):
    """A small, fixed evaluation sample: the first ~max_chars of every held-out file, cut at a line end."""
    out = []
    for rel, text in heldout:
        chunk = text[:max_chars]
        if len(text) > max_chars and "\n" in chunk:
            chunk = chunk[: chunk.rindex("\n") + 1]
        out.append({"path": rel, "text": chunk})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".train_data", help="output folder (keep it git-ignored)")
    ap.add_argument("--sample", default=None, help="also write the held-out sample JSON to this path")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, heldout = split_corpus()
    manifest = {
        "python": sys.version.split()[0],
        "stdlib": str(stdlib_root()),
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "heldout_rule": f"int(sha256(rel_path)[:8], 16) % 1000 < {HELDOUT_PER_MILLE}",
        "train_files": len(train),
        "heldout_files": len(heldout),
        "train_bytes": sum(len(t.encode()) for _, t in train),
        "heldout_bytes": sum(len(t.encode()) for _, t in heldout),
        "heldout_paths": [r for r, _ in heldout],
    }
    (out / "corpus.json").write_text(json.dumps(manifest, indent=1))
    print(json.dumps({k: v for k, v in manifest.items() if k != "heldout_paths"}, indent=1))
    if args.sample:
        sample = {
            "about": "First ~%d chars of each held-out file of the Python %s standard library (PSF license); "
            "never seen in training. Made by tools/train/corpus.py --sample." % (SAMPLE_CHARS, manifest["python"]),
            "files": heldout_sample(heldout),
        }
        Path(args.sample).write_text(json.dumps(sample, indent=1) + "\n")
    return train, heldout


if __name__ == "__main__":
    main()
