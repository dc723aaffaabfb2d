"""Drafters for DDTree speculative decoding, and the protocol for writing your own.

Protocol
--------
A drafter is either a callable ``drafter(context, depth, top_k)`` or an object with a method
``draft(context, depth, top_k)``. Each round the engine calls it with

* ``context``: int32 array [L], every committed token (prompt + generated so far), ending with
  this round's root (the last emitted token). It is a **read-only, zero-copy view of the
  engine's own buffer**: valid during the call only; copy it (``np.array(context)``) to keep it.
* ``depth``: D, the most future positions wanted (rows); ``top_k``: K, the most candidates per
  position (columns).

and it returns one of

* ``(logprobs, token_ids)``: float32 [d, k] and an integer array [d, k], d <= depth, k <= top_k,
  each row sorted by log-prob descending (``-inf`` entries are allowed and never verified);
  row i holds candidates for the token i+1 positions after the root;
* ``logits``: float32 [d, vocab] (the engine takes the top-k and log-softmax natively);
* ``None`` (or d = 0): no draft this round (the round is one plain AR step).

Anything else (wrong shape/dtype, NaN, ids outside the vocab, unsorted rows, d > depth,
k > top_k) raises ``ValueError`` naming the problem; an exception raised by the drafter itself
propagates unchanged. Either way the engine stays usable. The drafter never affects *what* is
generated (DDTree is lossless), only how many tokens each target forward yields.

Built-in drafters: ``OracleDrafter`` (knows the answer; optional noise), ``NgramDrafter``
(prompt lookup with per-depth continuation counts), ``ModelDrafter`` (a smaller model).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = ["OracleDrafter", "NgramDrafter", "ModelDrafter", "topk_logsoftmax"]


def topk_logsoftmax(logits: np.ndarray, k: int):
    """logits [d, V] -> (logprobs float32 [d, k'], ids int32 [d, k']) sorted descending,
    equal logits by lower id; k' = min(k, V)."""
    logits = np.asarray(logits, dtype=np.float32)
    d, V = logits.shape
    k = min(int(k), V)
    x = logits.astype(np.float64)
    mx = x.max(axis=1, keepdims=True)
    lse = mx + np.log(np.exp(x - mx).sum(axis=1, keepdims=True))
    # stable sort of -logits keeps lower ids first among equal logits
    order = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    lp = (np.take_along_axis(x, order, axis=1) - lse).astype(np.float32)
    return lp, order.astype(np.int32)


class OracleDrafter:
    """Knows the answer: proposes ``reference_tokens`` (the tokens the target will generate after
    the prompt, e.g. an AR run's ``result.tokens``).

    With ``noise`` > 0, at every depth independently and with probability ``noise``, the top-1
    candidate is replaced by a wrong token; the right token is then ranked lower (a random rank
    among the k) or, half of the time, absent. The other candidates are random wrong tokens.
    ``vocab_size`` bounds the random tokens (default: max(reference) + 2).

    The prompt length is learnt at the first call of each generation (the first context is
    prompt + the first generated token); pass ``prompt_len`` to fix it instead.
    """

    def __init__(self, reference_tokens, noise: float = 0.0, seed: int = 0, vocab_size: Optional[int] = None,
                 prompt_len: Optional[int] = None):
        self.reference = np.asarray(reference_tokens, dtype=np.int64).reshape(-1)
        if not 0.0 <= float(noise) <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {noise}")
        self.noise = float(noise)
        self.rng = np.random.default_rng(seed)
        self.vocab_size = int(vocab_size) if vocab_size is not None else int(self.reference.max(initial=0)) + 2
        self._fixed_prompt_len = prompt_len
        self._prompt_len = prompt_len
        self._last_len = None

    def draft(self, context, depth, top_k):
        n = len(context)
        if self._fixed_prompt_len is None and (self._last_len is None or n <= self._last_len):
            self._prompt_len = n - 1  # a new generation: context = prompt + first token
        self._last_len = n
        g = n - self._prompt_len  # generated tokens so far (root included)
        d = min(int(depth), len(self.reference) - g)
        if d <= 0:
            return None
        V = self.vocab_size
        k = max(1, min(int(top_k), V - 1)) if V > 1 else 1
        # the top candidate is confident (-0.01), the rest far below: a perfect oracle's chain is
        # always inside the tree when budget >= depth
        lp = np.tile(np.concatenate([[-0.01], -4.0 - np.arange(k - 1)]).astype(np.float32), (d, 1))
        ids = np.empty((d, k), dtype=np.int32)
        for j in range(d):
            right = int(self.reference[g + j])
            wrong_needed = k if self.noise else k - 1
            wrong = self.rng.choice(V - 1, size=min(wrong_needed, V - 1), replace=False) if wrong_needed else []
            wrong = [int(w) + (int(w) >= right) for w in wrong]  # skip `right`
            if self.noise and self.rng.random() < self.noise:
                row = wrong[:k]
                if k > 1 and self.rng.random() < 0.5:
                    row[int(self.rng.integers(1, k))] = right  # ranked lower
                # else: absent
            else:
                row = [right] + wrong[:k - 1]
            ids[j] = row
        return lp, ids

    __call__ = draft


class NgramDrafter:
    """Prompt lookup: finds earlier occurrences of the context's last n tokens (n from
    ``max_ngram`` down to ``min_ngram``) and counts what followed each occurrence at every offset
    1..depth. Each depth's counts (longer matches weigh more: weight n) become that depth's
    distribution, so several distinct continuations give a real tree, not a chain. Only the
    ``max_matches`` most recent occurrences per n are used."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_matches: int = 32):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram, self.max_matches = int(max_ngram), int(min_ngram), int(max_matches)

    def draft(self, context, depth, top_k):
        ctx = np.asarray(context)
        n = len(ctx)
        counts = [dict() for _ in range(depth)]
        for ng in range(self.max_ngram, self.min_ngram - 1, -1):
            if ng >= n:
                continue
            suffix = ctx[n - ng:]
            windows = sliding_window_view(ctx[:n - 1], ng)  # starts 0 .. n-1-ng (continuation exists)
            hits = np.flatnonzero((windows == suffix).all(axis=1))[-self.max_matches:]
            for s in hits:
                cont = ctx[s + ng:s + ng + depth]
                for j, t in enumerate(cont):
                    c = counts[j]
                    c[int(t)] = c.get(int(t), 0) + ng
        d = 0
        while d < depth and counts[d]:
            d += 1
        if d == 0:
            return None
        k = min(int(top_k), max(len(c) for c in counts[:d]))
        lp = np.full((d, k), -np.inf, dtype=np.float32)
        ids = np.zeros((d, k), dtype=np.int32)
        for j in range(d):
            items = sorted(counts[j].items(), key=lambda kv: (-kv[1], kv[0]))[:k]
            total = float(sum(counts[j].values()))
            for r, (tok, c) in enumerate(items):
                lp[j, r] = np.log(c / total)
                ids[j, r] = tok
        return lp, ids

    __call__ = draft


def _lowlevel(engine):
    """The object exposing forward(tokens, positions, visibility) / commit(keep) / reset() /
    cache_len: a native target, or the one inside a kn.Engine."""
    if all(hasattr(engine, a) for a in ("forward", "commit", "reset", "cache_len")):
        return engine
    from .generation import native_target

    return native_target(engine)


class ModelDrafter:
    """A smaller model (another ``kn.Engine``, or any native target) as the drafter: each round it
    decodes its own greedy chain for ``depth`` steps and returns every step's logits (the engine
    takes the top-k log-probs). It keeps its own cache across rounds: only committed context
    tokens are ever committed to it (the speculative chain stays pending and is overwritten), so
    after each round its cache is exactly the target's accepted context, and it forwards only the
    tokens accepted since the last round. A context that does not extend its cache (a new
    generation) resets it."""

    def __init__(self, engine, prefill_chunk: int = 512):
        self.model = _lowlevel(engine)
        self.prefill_chunk = int(prefill_chunk)
        self._tokens = np.zeros(0, dtype=np.int32)  # what its cache holds

    def _forward(self, tokens, start):
        T = len(tokens)
        pos = np.arange(start, start + T, dtype=np.int32)
        return np.asarray(self.model.forward(np.asarray(tokens, dtype=np.int32), pos, None))

    def draft(self, context, depth, top_k):
        ctx = np.asarray(context)
        m = len(self._tokens)
        if m >= len(ctx) or not np.array_equal(self._tokens, ctx[:m]) or self.model.cache_len != m:
            self.model.reset()
            m = 0
        max_len = int(self.model.max_seq_len)
        if len(ctx) >= max_len:
            return None
        # catch up on the accepted tokens (and the root) and commit them: they are final
        last = None
        for c0 in range(m, len(ctx), self.prefill_chunk):
            chunk = ctx[c0:c0 + self.prefill_chunk]
            logits = self._forward(chunk, c0)
            self.model.commit(np.arange(len(chunk), dtype=np.int32))
            last = logits[-1]
        self._tokens = np.array(ctx, dtype=np.int32)
        depth = min(int(depth), max_len - len(ctx))
        rows = [np.asarray(last, dtype=np.float32)]
        chain = []
        for _ in range(depth - 1):  # greedy chain, kept pending (never committed)
            chain.append(int(np.argmax(rows[-1])))
            rows.append(np.asarray(self._forward(chain, len(ctx))[-1], dtype=np.float32))
        return np.stack(rows).astype(np.float32, copy=False)

    __call__ = draft
