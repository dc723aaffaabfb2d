"""Generation: the Python face of the native loop (cpp/engine/engine.h, bindings/bind_engine.cpp).

``generate(engine, prompt_ids, max_new_tokens, drafter=None, ...)`` runs prefill, then plain
autoregressive decoding (``drafter=None`` or ``tree_budget=0``) or DDTree speculative decoding
with a drafter (see ``kdtree_native.drafters`` for the protocol and the built-in ones), and
returns a ``GenerationResult``. The whole loop runs in C++ with the GIL released; Python is
entered only to call the drafter and the ``progress`` callback.

Lossless by construction: at temperature 0 the output equals greedy AR decoding token for
token; at temperature > 0 each tree node's choice is a sample from the target's filtered
softmax(logits / T), and the sample for the token at sequence index i uses a uniform that
depends only on (seed, i), so DDTree and AR with the same seed emit the same tokens.

Statistics follow vLLM's definitions: an acceptance length counts the bonus token (a round that
accepts no draft token has length 1); the per-position acceptance rate at position i is the
fraction of drafted rounds whose accepted draft prefix reaches depth i.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import _native


@dataclass
class GenerationResult:
    tokens: np.ndarray              # int32 [n] generated tokens only
    acceptance_lengths: np.ndarray  # int32 [rounds] tokens emitted per round, bonus included
    stats: dict = field(default_factory=dict)
    # int32 [rounds] tree nodes verified per round, root excluded (0: a plain step)
    tree_sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    # int32 [rounds] rows the drafter gave per round (0: not asked, or it gave none); with adaptive_budget the
    # policy chooses how many rows to ask for, up to `depth`
    draft_depths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    @property
    def stopped(self) -> bool:
        return bool(self.stats.get("stopped", False))


# One native Generator (it owns the committed-token buffer drafters see) per target.
_GENERATORS: "dict[int, tuple[Any, Any]]" = {}
_MAX_CACHED = 16


_MODEL_TYPES = ("CpuModel", "CudaModel")


def native_target(engine):
    """The native object the loop drives: a ``_native.ToyTarget`` / ``_native.CpuModel`` given
    directly, or the one held by a ``kn.Engine``."""
    if isinstance(engine, (_native.ToyTarget,)) or type(engine).__name__ in _MODEL_TYPES:
        return engine
    for name in ("native_model", "_native_model", "_model", "model", "_target", "target"):
        obj = getattr(engine, name, None)
        if obj is not None and (isinstance(obj, _native.ToyTarget) or type(obj).__name__ in _MODEL_TYPES):
            return obj
    raise TypeError(f"generate: expected a kn.Engine (or a native target), got {type(engine).__name__}")


def _same_target(a, b) -> bool:
    try:
        return native_target(a) is native_target(b)
    except TypeError:  # (a drafter over some other object with forward / commit / reset)
        return False


_ROUNDS = ("auto", "host", "device")


def generator_for(engine, rounds: str = "auto"):
    """The (cached) native Generator of an engine or native target. ``rounds``: "auto" (on the
    GPU for a CUDA model, else the host), "host" (tree, logits and walk through the host path),
    "device" (CUDA model only: the round stays on the GPU)."""
    if rounds not in _ROUNDS:
        raise ValueError(f"rounds must be one of {_ROUNDS}, got {rounds!r}")
    target = native_target(engine)
    key = (id(target), rounds)
    hit = _GENERATORS.get(key)
    if hit is not None and hit[0] is target:
        return hit[1]
    gen = _native.Generator(target, rounds=rounds)
    if len(_GENERATORS) >= _MAX_CACHED:
        _GENERATORS.pop(next(iter(_GENERATORS)))
    _GENERATORS[key] = (target, gen)
    return gen


def as_draft_fn(drafter) -> Optional[Callable]:
    """Normalise the drafter protocol: None, an object with ``.draft(context, depth, top_k)``,
    or a callable ``drafter(context, depth, top_k)``."""
    if drafter is None:
        return None
    native = getattr(drafter, "_native_drafter", None)  # a C++ drafter the loop calls without Python
    native = native() if callable(native) else None
    if native is not None:
        return native
    draft = getattr(drafter, "draft", None)
    if callable(draft):
        return draft
    if callable(drafter):
        return drafter
    raise TypeError(
        f"drafter must be None, a callable drafter(context, depth, top_k) or an object with .draft(...); "
        f"got {type(drafter).__name__}")


_INT64_MAX = 2**63 - 1


def _int_arg(value, name, lo=0, hi=_INT64_MAX):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    value = int(value)
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return value


def _all_python_ints(arr) -> bool:
    """Whether an array NumPy could not give an integer dtype holds integers all the same (an
    object array: some are past the 64-bit range)."""
    return arr.dtype == object and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in arr.reshape(-1).tolist())


def _stop_ids(stop_token_ids):
    arr = np.asarray(stop_token_ids)
    if arr.ndim > 1:
        raise ValueError(f"stop_token_ids must be a sequence of token ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        # Python ints past the 64-bit range make an object array: out of range, not of the wrong type
        # (_int_arg names the first one).
        if not _all_python_ints(arr):
            raise TypeError(f"stop_token_ids must be integers, got dtype {arr.dtype}")
    return [_int_arg(t, "stop token id") for t in arr.reshape(-1).tolist()]


def _prompt_array(prompt_ids):
    arr = np.asarray(prompt_ids)
    if arr.ndim != 1:
        raise ValueError(f"prompt_ids must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        if _all_python_ints(arr):  # Python ints past the 64-bit range: out of the vocab, named
            bad = next(i for i, t in enumerate(arr.tolist()) if not -2**63 <= t < 2**63)
            raise ValueError(f"prompt token {arr[bad]} at index {bad} outside the vocab")
        raise ValueError(f"prompt_ids must be integers, got dtype {arr.dtype}")
    if arr.size == 0:
        raise ValueError("prompt_ids must contain at least one token")
    if arr.dtype.kind == "u" and arr.max() > _INT64_MAX:
        bad = int(np.argmax(arr > _INT64_MAX))
        raise ValueError(f"prompt token {int(arr[bad])} at index {bad} outside the vocab")
    return arr.astype(np.int64, copy=False)


def compute_stats(raw: dict, depth: int, drafted: bool, seed: int, temperature: float) -> dict:
    """Stats dict (vLLM definitions) from the native result."""
    acc = np.asarray(raw["acceptance_lengths"], dtype=np.int64)
    sizes = np.asarray(raw["tree_sizes"], dtype=np.int64)
    secs = dict(raw["seconds"])
    n = int(len(raw["tokens"]))
    rounds = int(acc.size)
    accepted = acc - 1  # draft tokens accepted per round (the bonus excluded)
    drafted_rounds = sizes > 0
    n_drafted = int(drafted_rounds.sum())
    per_pos = []
    if drafted:
        for i in range(1, depth + 1):
            per_pos.append(float((accepted[drafted_rounds] >= i).sum() / n_drafted) if n_drafted else 0.0)
    hist = np.bincount(acc, minlength=depth + 2)[1:depth + 2] if rounds else np.zeros(depth + 1, np.int64)
    total = float(secs.get("total", 0.0))
    decode = total - float(secs.get("prefill", 0.0))
    return {
        "num_tokens": n,
        "rounds": rounds,
        "mean_acceptance_length": float(acc.mean()) if rounds else 0.0,
        "per_position_acceptance_rate": per_pos,
        "acceptance_histogram": [int(x) for x in hist],  # [i] = rounds with acceptance length i+1
        "num_draft_tokens": int(sizes.sum()),             # tree nodes verified (root excluded)
        "mean_tree_size": float(sizes.mean()) if rounds else 0.0,
        "num_accepted_tokens": int(accepted.sum()),
        "draft_acceptance_rate": float(accepted.sum() / sizes.sum()) if sizes.sum() else 0.0,
        "seconds": {k: float(secs.get(k, 0.0)) for k in ("prefill", "draft", "tree_build", "verify",
                                                         "accept_commit", "total", "verify_forward_gpu")},
        "tokens_per_second": n / total if total > 0 else 0.0,
        "decode_tokens_per_second": (n - 1) / decode if decode > 0 and n > 1 else 0.0,
        "stopped": bool(raw["stopped"]),
        "device_drafts": int(raw.get("device_drafts", 0)),  # rounds whose draft came in GPU memory
        "seed": seed,
        "temperature": temperature,
    }


def generate(engine, prompt_ids, max_new_tokens: int, drafter=None, tree_budget: int = 64, depth: int = 15,
             top_k: Optional[int] = None, temperature: float = 0.0, top_p: float = 1.0,
             seed: Optional[int] = None, stop_token_ids: Sequence[int] = (), progress=None,
             target_top_k: Optional[int] = None, prefill_chunk: int = 512,
             rounds: str = "auto", adaptive_budget: bool = False, reuse_prefix: bool = False) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

    engine          a ``kn.Engine`` (or a native target: ``_native.CpuModel`` / ``_native.ToyTarget``)
    drafter         None (plain AR) or a drafter (``kdtree_native.drafters``: a callable
                    ``drafter(context, depth, top_k)`` or an object with ``.draft``)
    tree_budget     B, tree nodes verified per round besides the root (0 = AR); with
                    adaptive_budget, the most a round verifies
    adaptive_budget False: every round verifies min(B, finite-score prefixes) nodes. True: each
                    round verifies the n <= B best-first nodes that maximise the expected tokens
                    per second, from the draft's path probabilities (calibrated online against
                    what the target accepted; the tree is built in that calibrated order) and
                    the measured cost of rounds of each size, and the drafter is asked for the
                    rows recent drafts were worth at their measured cost (``depth`` the most)
                    (docs/ENGINE.md "Adaptive tree budget"). Output unchanged either way.
                    A draft in device memory is read on the host for this: its top-k
                    ([d, k]) copied back once a round.
    reuse_prefix    keep the cache entries the previous generate on this engine left for the
                    longest common prefix of its tokens (prompt + generated) and this prompt, and
                    prefill only the rest (multi-turn: the history is not recomputed); used only
                    when nothing has touched the cache since (the model's cache epoch: any forward,
                    commit, reset, truncate or weight change in between, by anyone, disables it).
                    CPU and CUDA models and the toy target.
                    stats["prefill_reused"] = the prompt tokens kept. The kept entries were computed
                    in other forward shapes than a fresh prefill's, so logits may differ from a
                    fresh call's in the last bits (the tokens, in a near tie).
    depth           D, how many future positions the drafter is asked for
    top_k           K, candidates per depth the drafter may return (None = min(B, vocab))
    temperature     0 = greedy; > 0 samples from softmax(logits / temperature)
    top_p, target_top_k
                    nucleus / top-k filtering of the *target* distribution (T > 0), identical in
                    AR and DDTree
    seed            sampling seed (None = a fresh random one, reported in stats["seed"])
    stop_token_ids  generation stops after the first of these (it is included in the output)
    progress        optional callback ``progress(new_tokens: int32 array, generated, max_new_tokens)``
                    called after the first token and after each round (streaming)
    rounds          where a round runs: "auto" (on the GPU for a CUDA model: tree build, verify,
                    choice, accept and KV compaction on the device, one small copy back per
                    round; the host otherwise), "host" (the host path of any target), "device"
    """
    return _prepare(engine, prompt_ids, max_new_tokens, drafter=drafter, tree_budget=tree_budget, depth=depth,
                    top_k=top_k, temperature=temperature, top_p=top_p, seed=seed, stop_token_ids=stop_token_ids,
                    target_top_k=target_top_k, prefill_chunk=prefill_chunk, rounds=rounds,
                    adaptive_budget=adaptive_budget, reuse_prefix=reuse_prefix)(progress)


def _prepare(engine, prompt_ids, max_new_tokens, drafter=None, tree_budget=64, depth=15, top_k=None,
             temperature=0.0, top_p=1.0, seed=None, stop_token_ids=(), target_top_k=None, prefill_chunk=512,
             rounds="auto", adaptive_budget=False, reuse_prefix=False) -> Callable:
    """Checks generate()'s arguments (raising what generate() raises) and returns run(progress) ->
    GenerationResult, which runs the call (stream() runs it in a thread)."""
    prompt = _prompt_array(prompt_ids)
    max_new_tokens = _int_arg(max_new_tokens, "max_new_tokens")
    tree_budget = _int_arg(tree_budget, "tree_budget")
    depth = _int_arg(depth, "depth", 1)
    top_k = 0 if top_k is None else _int_arg(top_k, "top_k", 1)
    target_top_k = 0 if target_top_k is None else _int_arg(target_top_k, "target_top_k", 1)
    temperature = float(temperature)
    with np.errstate(over="ignore"):  # (a value past float32 is refused below, without a warning)
        t32 = np.float32(temperature)
    if not np.isfinite(t32) or temperature < 0:  # (the native sampler works in float32)
        raise ValueError(f"temperature must be a finite float32 number >= 0, got {temperature}")
    top_p = float(top_p)
    if not (0.0 < top_p <= 1.0) or not np.float32(top_p) > 0:
        raise ValueError(f"top_p must be in (0, 1] (and above 0 as a float32), got {top_p}")
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    seed = _int_arg(seed, "seed", hi=None) & 0xFFFFFFFFFFFFFFFF  # (any size: its low 64 bits)
    stops = _stop_ids(stop_token_ids)
    prefill_chunk = _int_arg(prefill_chunk, "prefill_chunk", 1)
    for name, v in (("adaptive_budget", adaptive_budget), ("reuse_prefix", reuse_prefix)):
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {v!r}")
    fn = as_draft_fn(drafter)
    gen = generator_for(engine, rounds)
    from .drafters import ModelDrafter  # (lazy: drafters imports this module)
    if isinstance(drafter, ModelDrafter) and fn is not None and _same_target(drafter.model, engine):
        # (the native ModelDraft path names this in C++; the Python path would overwrite the cache)
        raise ValueError("ModelDrafter: the draft model is the target model itself (its cache would be "
                         "overwritten); load a second copy to draft with")

    def run(progress=None) -> GenerationResult:
        if progress is not None and not callable(progress):
            raise TypeError(f"progress must be callable, got {type(progress).__name__}")
        raw = gen.generate(prompt, max_new_tokens, drafter=fn, tree_budget=tree_budget, depth=depth, top_k=top_k,
                           temperature=temperature, top_p=top_p, target_top_k=target_top_k, seed=seed,
                           stop_token_ids=stops, progress=progress, prefill_chunk=prefill_chunk,
                           adaptive_budget=bool(adaptive_budget), reuse_prefix=bool(reuse_prefix))
        stats = compute_stats(raw, depth, fn is not None and tree_budget > 0, seed, temperature)
        stats["rounds_on"] = gen.rounds
        stats["prefill_reused"] = int(raw.get("prefill_reused", 0))
        return GenerationResult(tokens=raw["tokens"], acceptance_lengths=raw["acceptance_lengths"], stats=stats,
                                tree_sizes=np.asarray(raw["tree_sizes"], dtype=np.int32),
                                draft_depths=np.asarray(raw["draft_depths"], dtype=np.int32))

    return run


class _StreamClosed(Exception):
    """Raised inside a stream's progress callback once the stream is closed: ends its generate."""


_END = object()


class _StreamState:
    """What a stream's thread shares with its TokenStream (the thread holds this, not the stream, so
    a dropped stream is collected and its __del__ can stop the call)."""

    def __init__(self):
        import queue
        import threading

        self.queue = queue.SimpleQueue()
        self.closed = threading.Event()
        self.error: Optional[BaseException] = None
        self.result: Optional[GenerationResult] = None


class TokenStream:
    """The new tokens of one generate call, round by round, as it runs (``stream()``,
    ``kn.Engine.stream``): iterate to get int32 arrays (the first token, then each round's accepted
    tokens and bonus); their concatenation is ``generate()``'s ``tokens``. The call runs in a
    background thread (the native loop releases the GIL); an error it raises (a drafter's, a bad
    draft) is raised by the iteration. ``result`` is the ``GenerationResult`` once the stream is
    exhausted. ``close()`` (or leaving a ``with`` block) stops the call at its next round and waits
    for it; a stream dropped unfinished stops its call at the next round without waiting. The
    engine is usable again after."""

    def __init__(self, run: Callable, progress=None, on_done: Optional[Callable] = None):
        import threading

        if progress is not None and not callable(progress):
            raise TypeError(f"progress must be callable, got {type(progress).__name__}")
        st = self._state = _StreamState()
        self._finished = False

        def cb(new_tokens, done, total):
            if st.closed.is_set():
                raise _StreamClosed()
            st.queue.put(np.array(new_tokens, dtype=np.int32, copy=True))
            if progress is not None:
                progress(new_tokens, done, total)

        def body():
            try:
                st.result = run(cb)
            except _StreamClosed:
                pass
            except BaseException as e:  # handed to the iterating thread
                st.error = e
            finally:
                if on_done is not None:
                    on_done()
                st.queue.put(_END)

        self._thread = threading.Thread(target=body, name="kdtree-native stream", daemon=True)
        self._thread.start()

    @property
    def result(self) -> Optional[GenerationResult]:
        return self._state.result

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        if self._finished:
            raise StopIteration
        st = self._state
        item = st.queue.get()
        if item is _END:
            self._finished = True
            self._thread.join()
            if st.error is not None:
                err, st.error = st.error, None
                raise err
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop the call (at its next round) and wait for it to end."""
        if self._finished:
            return
        st = self._state
        st.closed.set()
        while st.queue.get() is not _END:
            pass
        self._finished = True
        self._thread.join()
        st.error = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # (dropped without close(): ask the call to stop at its next round, without waiting: a wait here
        # could block interpreter shutdown, where the thread is no longer scheduled)
        st = getattr(self, "_state", None)
        if st is not None:
            st.closed.set()


def stream(engine, prompt_ids, max_new_tokens: int, drafter=None, progress=None, **kwargs) -> TokenStream:
    """``generate()`` as an iterator of each round's new tokens (a ``TokenStream``). The arguments
    are generate()'s and are checked here, before anything runs (the same errors)."""
    return TokenStream(_prepare(engine, prompt_ids, max_new_tokens, drafter=drafter, **kwargs), progress)
