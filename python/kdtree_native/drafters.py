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

The arrays may be numpy arrays, CPU arrays with DLPack (torch CPU tensors: read as numpy views,
no copy) or GPU arrays (torch CUDA tensors, CuPy, ... through ``__cuda_array_interface__`` or
DLPack): with a CUDA target on the same GPU the round reads those in place, checked on the
device (``stats["device_drafts"]`` counts such rounds; docs/ENGINE.md "Device arrays").

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

from . import _native

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


def _context_ids(context) -> np.ndarray:
    """A drafter's context as int32 ids, refusing what int32 would change (floats, negatives, ids past
    2**31 - 1: they used to wrap silently on direct ``draft`` calls)."""
    ctx = np.asarray(context).reshape(-1)
    if ctx.dtype == np.int32:
        if ctx.size and ctx.min() < 0:
            raise ValueError(f"context holds a negative token id ({int(ctx.min())})")
        return ctx
    if ctx.size and ctx.dtype.kind not in "iu":
        raise TypeError(f"context must hold integer token ids, got dtype {ctx.dtype}")
    if ctx.size and (ctx.min() < 0 or ctx.max() > np.iinfo(np.int32).max):
        bad = ctx.min() if ctx.min() < 0 else ctx.max()
        raise ValueError(f"context holds token id {int(bad)}, outside [0, 2**31 - 1]")
    return ctx.astype(np.int32)


class NgramDrafter:
    """Prompt lookup: finds earlier occurrences of the context's last n tokens (n from
    ``max_ngram`` down to ``min_ngram``) and counts what followed each occurrence at every offset
    1..depth. Each depth's counts (longer matches weigh more: weight n) become that depth's
    distribution, so several distinct continuations give a real tree, not a chain. Only the
    ``max_matches`` most recent occurrences per n are used.

    Runs in C++ (``_native.NgramDraft``): ``generate`` calls it inside the round without a Python
    callback; ``draft`` gives the same arrays to Python. ``kdtree_native.reference.ngram_draft`` is
    the NumPy definition it is tested against, bit for bit. A subclass that overrides ``draft`` is
    called through Python as any drafter."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_matches: int = 32):
        for name, v in (("max_ngram", max_ngram), ("min_ngram", min_ngram), ("max_matches", max_matches)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name} must be an integer, got {type(v).__name__}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        self.max_ngram, self.min_ngram, self.max_matches = int(max_ngram), int(min_ngram), int(max_matches)
        self._native = _native.NgramDraft(self.max_ngram, self.min_ngram, self.max_matches)

    def draft(self, context, depth, top_k):
        return self._native(_context_ids(context), int(depth), int(top_k))

    def __reduce__(self):  # picklable / copyable: the native object is rebuilt from the parameters
        return (type(self), (self.max_ngram, self.min_ngram, self.max_matches))

    def __repr__(self):
        return f"NgramDrafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram}, max_matches={self.max_matches})"

    __call__ = draft

    def _native_drafter(self):
        """The C++ drafter generate() may call directly, or None where ``draft`` is overridden."""
        return self._native if type(self).draft is NgramDrafter.draft else None


def _native_model_of(engine):
    """The native model (CpuModel / CudaModel) of a kn.Engine or the model itself; None otherwise."""
    from .generation import native_target

    classes = tuple(getattr(_native, name) for name in ("CpuModel", "CudaModel") if hasattr(_native, name))
    try:
        obj = native_target(engine)
    except TypeError:
        return None
    return obj if isinstance(obj, classes) else None


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
    takes the top-k log-probs natively).

    Its cache follows the committed context: at each call it rolls back to the longest common
    prefix of what it holds and the new context (``truncate``), feeds only the tokens after it
    (the accepted ones and the new root, one forward), then decodes the chain one token at a time
    (forward T = 1 + commit: linear in the depth). The chain's tokens stay in the cache (fifty-ninth
    session; on a CPU model: over a CUDA model the cache is truncated back to the context, as the GPU
    drafter does): where the target accepts them, the next call finds them in the common prefix and
    feeds only the tokens after them. A new generation with the same prompt reuses the prompt's cache.

    ``min_chain_prob`` > 0 stops the chain early: once the product of the chain's top-1
    probabilities falls below it, the deeper rows (which a best-first tree of a modest budget
    rarely reaches) are not drafted, and fewer than ``depth`` rows are returned.

    A target without ``truncate`` (e.g. ``_native.ToyTarget``) is driven the old way: the chain
    stays pending and is re-forwarded from the context at each step (O(depth^2) tokens), and a
    context that does not extend its cache resets it.

    Over a native model (``CpuModel`` / ``CudaModel``, e.g. a ``kn.Engine``) it runs in C++
    (``_native.ModelDraft``, ``native=None`` or ``True``): ``generate`` calls it inside the round
    without Python, and on the GPU the chain stays on the device (one small copy back per call)
    and a GPU round takes its logits there without a copy. ``native=False`` keeps the Python
    definition below (the C++ one is tested against it). A subclass that overrides ``draft`` is
    called through Python as any drafter."""

    def __init__(self, engine, prefill_chunk: int = 512, min_chain_prob: float = 0.0, native: Optional[bool] = None):
        self.model = _lowlevel(engine)
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        self.prefill_chunk = int(prefill_chunk)
        if not 0.0 <= float(min_chain_prob) < 1.0:
            raise ValueError(f"min_chain_prob must be in [0, 1), got {min_chain_prob}")
        self.min_chain_prob = float(min_chain_prob)
        self._can_truncate = callable(getattr(self.model, "truncate", None))
        self._tokens = np.zeros(0, dtype=np.int32)  # what its committed cache holds
        self._one = np.zeros(1, dtype=np.int32)
        inner = _native_model_of(engine)
        # the chain's tokens stay in the cache (the C++ drafter's host path); the GPU drafter truncates them
        cuda_cls = getattr(_native, "CudaModel", None)
        self._keep_chain = not (cuda_cls is not None and isinstance(inner, cuda_cls))
        if native and inner is None:
            raise ValueError(f"ModelDrafter(native=True) needs a native model (CpuModel or CudaModel), "
                             f"got {type(engine).__name__}")
        self._native = (_native.ModelDraft(inner, self.min_chain_prob, self.prefill_chunk)
                        if inner is not None and native is not False else None)

    def _forward(self, tokens, start):
        T = len(tokens)
        pos = np.arange(start, start + T, dtype=np.int32)
        return np.asarray(self.model.forward(np.asarray(tokens, dtype=np.int32), pos, None))

    def _sync(self, ctx):
        """Make the committed cache hold exactly ``ctx``; returns the logits after its last token."""
        held = self._tokens
        n = len(ctx)
        if self.model.cache_len != len(held):  # someone else moved the cache: start over
            held = self._tokens = np.zeros(0, dtype=np.int32)
            self.model.reset()
        m = min(len(held), n - 1)  # feed at least the root: its logits are the first row
        if m > 0:
            diff = np.flatnonzero(held[:m] != ctx[:m])
            if len(diff):
                m = int(diff[0])
        if m < len(held):
            if self._can_truncate:
                self.model.truncate(m)
            else:
                self.model.reset()
                m = 0
        last = None
        # (the native models' forward_last: the LM head over the rows asked for alone, as the C++ drafter's
        # feed does, so both give the same bits)
        forward_last = getattr(self.model, "forward_last", None)
        for c0 in range(m, n, self.prefill_chunk):
            chunk = ctx[c0:c0 + self.prefill_chunk]
            if forward_last is not None:
                pos = np.arange(c0, c0 + len(chunk), dtype=np.int32)
                logits = forward_last(np.asarray(chunk, dtype=np.int32), pos, 1 if c0 + len(chunk) == n else 0)
            else:
                logits = self._forward(chunk, c0)
            self.model.commit(np.arange(len(chunk), dtype=np.int32))
            if len(logits):
                last = logits[-1]
        self._tokens = np.array(ctx, dtype=np.int32)
        return np.asarray(last, dtype=np.float32)

    def _native_drafter(self):
        """The C++ drafter generate() may call directly, or None (Python path, or ``draft`` overridden)."""
        return self._native if type(self).draft is ModelDrafter.draft else None

    def draft(self, context, depth, top_k):
        if self._native is not None:
            return self._native(_context_ids(context), int(depth), int(top_k))
        ctx = _context_ids(context)
        n = len(ctx)
        max_len = int(self.model.max_seq_len)
        if n == 0 or n >= max_len:
            return None
        row = self._sync(ctx)
        if not self._can_truncate:
            return self._draft_pending(ctx, row, depth)
        depth = min(int(depth), max_len - n + 1)  # the chain commits depth - 1 tokens after ctx
        rows = [row]
        log_min = np.log(self.min_chain_prob) if self.min_chain_prob > 0 else None
        cum = 0.0
        chain = []
        try:
            for i in range(1, depth):  # greedy chain: one token per step, committed and kept (the class doc)
                tok = int(np.argmax(row))
                if log_min is not None:
                    mx = float(row[tok])
                    cum += -float(np.log(np.exp(row.astype(np.float64) - mx).sum()))  # log p(top-1), float64
                    if cum < log_min:
                        break
                logits = self.model.forward(np.array([tok], dtype=np.int32), np.array([n + i - 1], dtype=np.int32),
                                            None)
                self.model.commit(self._one)
                chain.append(tok)
                row = np.asarray(logits[0], dtype=np.float32)
                rows.append(row)
        except BaseException:
            self.model.truncate(n)  # (the cache back to the context it holds for sure)
            raise
        if self._keep_chain:
            self._tokens = np.concatenate([self._tokens, np.asarray(chain, dtype=np.int32)])
        else:
            self.model.truncate(n)
        return np.stack(rows)

    def _draft_pending(self, ctx, row, depth):
        n = len(ctx)
        depth = min(int(depth), int(self.model.max_seq_len) - n)
        rows = [row]
        chain = []
        for _ in range(depth - 1):  # greedy chain, kept pending (never committed)
            chain.append(int(np.argmax(rows[-1])))
            rows.append(np.asarray(self._forward(chain, n)[-1], dtype=np.float32))
        return np.stack(rows).astype(np.float32, copy=False)

    __call__ = draft
