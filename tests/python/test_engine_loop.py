"""The generation loop (cpp/engine, bindings/bind_engine.cpp, kdtree_native.generation):
losslessness at T=0 (DDTree == AR token for token for good, noisy, n-gram, model and adversarial
drafters over budgets x depths, on the toy target and on random HF checkpoints), exact
max_new_tokens / stop tokens / max_seq_len, the zero-copy context view, drafter errors, GIL
release, stats. Shared helpers live here too (test_drafters.py / test_sampling.py import them).
"""
import os
import threading
import time
import traceback

import warnings

import numpy as np
import pytest

import kdtree_native as kn
from kdtree_native import _native
from kdtree_native.drafters import ModelDrafter, NgramDrafter, OracleDrafter
from kdtree_native.generation import generate

BUDGETS = (0, 1, 16, 64, 256)
DEPTHS = (1, 4, 15)


# ---- helpers (also used by test_drafters.py and test_sampling.py) ---------------------------

def toy(vocab=64, max_seq_len=512, seed=0, scale=3.0):
    return _native.ToyTarget(vocab, max_seq_len, seed, scale)


def load_model(path, max_seq_len=256):
    """A native target for an HF checkpoint dir: kn.Engine.from_pretrained when it exists, else
    a CpuModel filled straight from the safetensors."""
    try:
        return kn.Engine.from_pretrained(path, device="cpu", max_seq_len=max_seq_len)
    except (NotImplementedError, AttributeError, TypeError):
        pass
    from kdtree_native.checkpoint import load_weights
    from kdtree_native.config import load_config

    cfg = load_config(path)
    m = _native.CpuModel(cfg.to_native(), max_seq_len)
    for name, arr in load_weights(path, cfg).items():
        m.set_weight(name, np.ascontiguousarray(arr, dtype=np.float32))
    m.finalize()
    return m


class AllWrongDrafter:
    """Every candidate is a token the target will not pick (relative to the AR reference)."""

    def __init__(self, reference, vocab, prompt_len):
        self.ref, self.V, self.P = np.asarray(reference), vocab, prompt_len

    def __call__(self, ctx, depth, top_k):
        g = len(ctx) - self.P
        d = min(depth, len(self.ref) - g)
        if d <= 0:
            return None
        k = min(top_k, self.V - 1)
        ids = np.array([[(int(self.ref[g + j]) + 1 + r) % self.V for r in range(k)] for j in range(d)], np.int32)
        return np.tile(-np.arange(k, dtype=np.float32), (d, 1)), ids


def duplicate_drafter(ctx, depth, top_k):
    """Duplicate token ids at every depth (several children with the same token)."""
    t = int(ctx[-1]) % 32
    ids = np.full((depth, top_k), t, np.int32)
    ids[:, ::2] = (t * 7 + 3) % 32
    return np.tile(-np.arange(top_k, dtype=np.float32) * 0.5, (depth, 1)), ids


def neginf_drafter(ctx, depth, top_k):
    """-inf log-probs everywhere but the first column."""
    lp = np.full((depth, top_k), -np.inf, np.float32)
    lp[:, 0] = -1.0
    ids = (np.arange(depth * top_k).reshape(depth, top_k) + int(ctx[-1])) % 32
    return lp, ids.astype(np.int32)


def all_neginf_drafter(ctx, depth, top_k):
    return np.full((depth, top_k), -np.inf, np.float32), np.zeros((depth, top_k), np.int32)


def short(inner):
    """Wraps a drafter to return fewer rows than asked (d < depth)."""
    def f(ctx, depth, top_k):
        r = inner(ctx, depth, top_k)
        if r is None:
            return None
        lp, ids = r
        d = max(1, lp.shape[0] // 2)
        return lp[:d], ids[:d]
    return f


def random_logits_drafter(vocab, seed=0):
    rng = np.random.default_rng(seed)
    return lambda ctx, depth, top_k: rng.standard_normal((depth, vocab)).astype(np.float32)


def drafter_zoo(ref, vocab, prompt_len, draft_target):
    """name -> fresh drafter; `ref` = the AR tokens for the prompt."""
    return {
        "oracle": lambda: OracleDrafter(ref, 0.0, seed=1, vocab_size=vocab),
        "oracle_0.3": lambda: OracleDrafter(ref, 0.3, seed=2, vocab_size=vocab),
        "oracle_0.9": lambda: OracleDrafter(ref, 0.9, seed=3, vocab_size=vocab),
        "ngram": lambda: NgramDrafter(),
        "model": lambda: ModelDrafter(draft_target),
        "all_wrong": lambda: AllWrongDrafter(ref, vocab, prompt_len),
        "duplicates": lambda: duplicate_drafter,
        "neginf": lambda: neginf_drafter,
        "all_neginf": lambda: all_neginf_drafter,
        "short": lambda: short(OracleDrafter(ref, 0.0, seed=4, vocab_size=vocab)),
        "logits": lambda: random_logits_drafter(vocab, 5),
    }


def check_stats(res, depth):
    s = res.stats
    acc = res.acceptance_lengths
    assert res.tokens.dtype == np.int32 and acc.dtype == np.int32
    assert s["rounds"] == len(acc)
    if len(res.tokens):
        assert 1 + int(acc.sum()) == len(res.tokens)  # the prefill token + every round's emission
    assert (acc >= 1).all() and (acc <= depth + 1).all()
    assert sum(s["acceptance_histogram"]) == s["rounds"]
    rates = s["per_position_acceptance_rate"]
    assert all(0 <= r <= 1 for r in rates) and all(a >= b for a, b in zip(rates, rates[1:]))
    assert all(v >= 0 for v in s["seconds"].values())
    if s.get("rounds_on", "host") == "host":
        assert s["seconds"]["verify_forward_gpu"] == 0.0  # only the GPU round times its forwards
    if s["rounds"]:
        assert s["mean_acceptance_length"] == pytest.approx(float(acc.mean()))


# ---- toy target ------------------------------------------------------------------------------

PROMPT = np.array([5, 9, 2, 7, 5, 9, 2, 11, 3], dtype=np.int64)


@pytest.fixture(scope="module")
def toy_setup():
    V = 48
    tgt = toy(V, 512, seed=7)
    drf = toy(V, 512, seed=8)  # another "model" for ModelDrafter
    ar = generate(tgt, PROMPT, 60)
    return tgt, drf, V, ar.tokens


def test_toy_target_sees_mask_and_compaction():
    """The toy's logits really depend on the visibility and on what commit kept."""
    t = toy(32, 64, seed=1)
    t.forward(np.array([1, 2, 3], np.int32), np.arange(3, dtype=np.int32), None)
    t.commit(np.arange(3, dtype=np.int32))
    toks, pos = np.array([4, 5, 6], np.int32), np.array([3, 4, 4], np.int32)
    chain = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    a = t.forward(toks, pos, chain)
    b = t.forward(toks, pos, np.array([[1, 0, 0], [1, 1, 0], [1, 1, 1]], bool))  # node 2 wrongly sees 1
    assert np.array_equal(a[:2], b[:2]) and not np.array_equal(a[2], b[2])
    t.commit(np.array([0, 2], np.int32))  # keep root + node 2
    c = t.forward(np.array([9], np.int32), np.array([5], np.int32), None)
    t2 = toy(32, 64, seed=1)
    t2.forward(np.array([1, 2, 3, 4, 6], np.int32), np.array([0, 1, 2, 3, 4], np.int32), None)
    t2.commit(np.arange(5, dtype=np.int32))
    assert np.array_equal(c, t2.forward(np.array([9], np.int32), np.array([5], np.int32), None))
    t3 = toy(32, 64, seed=1)  # a wrong compaction (node 1 kept) gives different logits
    t3.forward(np.array([1, 2, 3, 4, 5], np.int32), np.array([0, 1, 2, 3, 4], np.int32), None)
    t3.commit(np.arange(5, dtype=np.int32))
    assert not np.array_equal(c, t3.forward(np.array([9], np.int32), np.array([5], np.int32), None))


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("depth", DEPTHS)
def test_lossless_toy(toy_setup, budget, depth):
    tgt, drf, V, ref = toy_setup
    for name, make in drafter_zoo(ref, V, len(PROMPT), drf).items():
        res = generate(tgt, PROMPT, len(ref), drafter=make(), tree_budget=budget, depth=depth)
        assert np.array_equal(res.tokens, ref), (name, budget, depth)
        check_stats(res, depth)
        if budget == 0:
            assert (res.acceptance_lengths == 1).all()


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("budget", (16, 64, 256))
def test_perfect_oracle_accepts_everything(toy_setup, budget, depth):
    tgt, _, V, ref = toy_setup
    rounds = 3
    n = 1 + rounds * (depth + 1)
    res = generate(tgt, PROMPT, n, drafter=OracleDrafter(ref, vocab_size=V), tree_budget=budget, depth=depth)
    assert np.array_equal(res.tokens, ref[:n])
    assert res.stats["rounds"] == rounds
    assert res.stats["mean_acceptance_length"] == 1 + depth
    assert res.stats["per_position_acceptance_rate"] == [1.0] * depth
    assert res.stats["acceptance_histogram"][-1] == rounds


def test_max_new_tokens_exact_and_edges(toy_setup):
    tgt, _, V, ref = toy_setup
    o = lambda: OracleDrafter(ref, vocab_size=V)  # noqa: E731
    for n in (0, 1, 2, 3, 7, 16, 17, 33):
        res = generate(tgt, PROMPT, n, drafter=o(), tree_budget=64, depth=15)
        assert np.array_equal(res.tokens, ref[:n]), n
        check_stats(res, 15)
    assert generate(tgt, PROMPT, 0).stats["rounds"] == 0
    assert generate(tgt, PROMPT, 1).stats["rounds"] == 0
    res = generate(tgt, PROMPT[:1], 5)  # one-token prompt
    assert len(res.tokens) == 5


def test_stop_tokens_inside_an_accepted_path(toy_setup):
    tgt, _, V, ref = toy_setup
    stop = int(ref[9])
    first = int(np.flatnonzero(ref == stop)[0])
    res = generate(tgt, PROMPT, 60, drafter=OracleDrafter(ref, vocab_size=V), tree_budget=64, depth=15,
                   stop_token_ids=[stop, V - 1 if V - 1 not in ref[:first] else stop])
    assert np.array_equal(res.tokens, ref[:first + 1]) and res.stopped
    check_stats(res, 15)
    ar = generate(tgt, PROMPT, 60, stop_token_ids=[stop])
    assert np.array_equal(ar.tokens, res.tokens)
    first_tok = int(ref[0])  # the prefill token itself can stop generation
    assert np.array_equal(generate(tgt, PROMPT, 60, stop_token_ids=[first_tok]).tokens, ref[:1])


def test_max_seq_len_check_and_tree_shrink():
    V = 40
    tgt = toy(V, 32, seed=3)
    P = np.arange(1, 11)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(tgt, P, 23)
    ar = generate(tgt, P, 22)  # fills the cache exactly: the tree must shrink to fit
    assert len(ar.tokens) == 22
    for budget in (16, 64, 256):
        res = generate(tgt, P, 22, drafter=OracleDrafter(ar.tokens, 0.3, vocab_size=V), tree_budget=budget, depth=15)
        assert np.array_equal(res.tokens, ar.tokens)
        res = generate(tgt, P, 22, drafter=NgramDrafter(), tree_budget=budget, depth=15)
        assert np.array_equal(res.tokens, ar.tokens)


def test_bad_arguments_raise_and_engine_stays_usable(toy_setup):
    tgt, _, V, ref = toy_setup
    with pytest.raises(ValueError, match="at least one"):
        generate(tgt, [], 4)
    with pytest.raises(ValueError, match="outside the vocab"):
        generate(tgt, [1, V + 3], 4)
    with pytest.raises(ValueError, match="integers"):
        generate(tgt, [1.5, 2.0], 4)
    with pytest.raises(ValueError, match="temperature"):
        generate(tgt, PROMPT, 4, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        generate(tgt, PROMPT, 4, top_p=0.0)
    with pytest.raises(ValueError, match="depth"):
        generate(tgt, PROMPT, 4, drafter=NgramDrafter(), depth=0)
    with pytest.raises(ValueError, match="depth"):
        generate(tgt, PROMPT, 4, drafter=NgramDrafter(), depth=65)
    with pytest.raises(ValueError, match="stop token"):
        generate(tgt, PROMPT, 4, stop_token_ids=[V])
    with pytest.raises(TypeError, match="drafter"):
        generate(tgt, PROMPT, 4, drafter=42)
    with pytest.raises(TypeError):
        generate(object(), PROMPT, 4)
    assert np.array_equal(generate(tgt, PROMPT, len(ref)).tokens, ref)


def test_huge_integer_arguments_are_clear_errors(toy_setup):
    """max_new_tokens near 2**63 used to overflow the prompt + max_new_tokens check in C++: the
    loop then ran past the token buffer (heap corruption, a crash at exit). Values past int64,
    float stop ids, a uint64 prompt past int64 and float32-overflowing sampling values are named
    as such, and the engine stays usable."""
    tgt, _, V, ref = toy_setup
    for n in (2**63 - 1, 2**62, 2**63 - len(PROMPT)):
        with pytest.raises(ValueError, match="exceeds max_seq_len"):
            generate(tgt, PROMPT, n)
        with pytest.raises(ValueError, match="exceeds max_seq_len"):
            generate(tgt, PROMPT, n, drafter=NgramDrafter(), tree_budget=8, depth=4)
    for kw in ("max_new_tokens", "tree_budget", "depth", "top_k", "target_top_k", "prefill_chunk"):
        args = dict(max_new_tokens=4)
        args[kw] = 2**63
        with pytest.raises(ValueError, match=kw + r" must be <= 9223372036854775807"):
            generate(tgt, PROMPT, **args)
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1"):
        generate(tgt, PROMPT, 4, prefill_chunk=0)
    with pytest.raises(TypeError, match="prefill_chunk must be an integer"):
        generate(tgt, PROMPT, 4, prefill_chunk=2.5)
    with pytest.raises(TypeError, match="stop_token_ids must be integers"):
        generate(tgt, PROMPT, 4, stop_token_ids=[4.9])
    with pytest.raises(TypeError, match="stop_token_ids must be integers"):
        generate(tgt, PROMPT, 4, stop_token_ids="4")
    with pytest.raises(ValueError, match="stop_token_ids must be a sequence"):
        generate(tgt, PROMPT, 4, stop_token_ids=[[4]])
    with pytest.raises(ValueError, match="prompt token 18446744073709551615 at index 1"):
        generate(tgt, np.array([1, 2**64 - 1], np.uint64), 4)
    with pytest.raises(ValueError, match="prompt token 1180591620717411303424 at index 1 outside the vocab"):
        generate(tgt, [1, 2**70], 4)  # (a Python int past int64: an object array)
    with pytest.raises(ValueError, match="prompt token -18446744073709551616 at index 0"):
        generate(tgt, [-2**64, 1], 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused without NumPy's overflow warning on the way
        with pytest.raises(ValueError, match="temperature"):
            generate(tgt, PROMPT, 4, temperature=1e39)
    with pytest.raises(ValueError, match="top_p"):
        generate(tgt, PROMPT, 4, top_p=1e-300)
    assert np.array_equal(generate(tgt, PROMPT, 4, seed=2**200, temperature=0.5).tokens.shape, (4,))
    assert np.array_equal(generate(tgt, PROMPT, len(ref), stop_token_ids=np.array([], np.int64)).tokens, ref)
    assert np.array_equal(generate(tgt, PROMPT, len(ref)).tokens, ref)


def test_stop_ids_past_int64_are_out_of_range(toy_setup):
    """A stop id past int64 makes NumPy build an object array; it used to be refused as a TypeError
    ("must be integers, got dtype object") although it is an integer: it is a ValueError naming
    the value, like every other out-of-range integer argument. Non-integers stay TypeErrors."""
    tgt, _, V, ref = toy_setup
    for stops in ([2**70], [1, 2**70], (2**64,), [np.int64(3), 2**100]):
        big = next(int(t) for t in stops if int(t) > 2**63 - 1)
        with pytest.raises(ValueError, match=f"stop token id must be <= 9223372036854775807, got {big}"):
            generate(tgt, PROMPT, 4, stop_token_ids=stops)
    with pytest.raises(ValueError, match=f"stop token id must be >= 0, got {-2**70}"):
        generate(tgt, PROMPT, 4, stop_token_ids=[-2**70])
    for stops in ([None], [1, None], [2**70, "a"], [2**70, 1.5], [True]):
        with pytest.raises(TypeError, match="stop_token_ids must be integers"):
            generate(tgt, PROMPT, 4, stop_token_ids=stops)
    assert np.array_equal(generate(tgt, PROMPT, len(ref)).tokens, ref)


class Boom(RuntimeError):
    pass


def test_drafter_exception_propagates_unchanged(toy_setup):
    tgt, _, V, ref = toy_setup
    calls = []

    def bad(ctx, depth, top_k):
        calls.append(1)
        if len(calls) == 3:
            raise Boom("drafter exploded on purpose")
        return OracleDrafter(ref, vocab_size=V, prompt_len=len(PROMPT)).draft(ctx, depth, top_k)

    with pytest.raises(Boom, match="exploded on purpose") as ei:
        generate(tgt, PROMPT, 40, drafter=bad, tree_budget=16, depth=4)
    tb = "".join(traceback.format_exception(ei.type, ei.value, ei.tb))
    assert "in bad" in tb  # the drafter's own frame is in the traceback
    res = generate(tgt, PROMPT, len(ref), drafter=OracleDrafter(ref, vocab_size=V), tree_budget=16, depth=4)
    assert np.array_equal(res.tokens, ref)

    def bad_progress(new, done, total):
        raise KeyError("progress failed")

    with pytest.raises(KeyError, match="progress failed"):
        generate(tgt, PROMPT, 10, progress=bad_progress)
    assert np.array_equal(generate(tgt, PROMPT, len(ref)).tokens, ref)


def _ok(ctx, depth, top_k):
    return np.zeros((depth, 1), np.float32), np.zeros((depth, 1), np.int32)


BAD_OUTPUTS = {
    "float64 logprobs": (lambda d, k, V: (np.zeros((d, 1)), np.zeros((d, 1), np.int32)), "float32"),
    "float token ids": (lambda d, k, V: (np.zeros((d, 1), np.float32), np.zeros((d, 1))), "integer"),
    "1-D arrays": (lambda d, k, V: (np.zeros(d, np.float32), np.zeros(d, np.int32)), "2-D"),
    "shape mismatch": (lambda d, k, V: (np.zeros((d, 1), np.float32), np.zeros((d, 2), np.int32)), "shapes differ"),
    "NaN": (lambda d, k, V: (np.full((d, 1), np.nan, np.float32), np.zeros((d, 1), np.int32)), "NaN"),
    "+inf": (lambda d, k, V: (np.full((d, 1), np.inf, np.float32), np.zeros((d, 1), np.int32)), r"\+inf"),
    "id >= vocab": (lambda d, k, V: (np.zeros((d, 1), np.float32), np.full((d, 1), V, np.int32)), "outside the vocab"),
    "negative id": (lambda d, k, V: (np.zeros((d, 1), np.float32), np.full((d, 1), -1, np.int64)), "outside the vocab"),
    "unsorted": (lambda d, k, V: (np.array([[-2.0, -1.0]] * d, np.float32), np.zeros((d, 2), np.int32)), "sorted"),
    "d > depth": (lambda d, k, V: (np.zeros((d + 1, 1), np.float32), np.zeros((d + 1, 1), np.int32)), "d <= depth"),
    "k > top_k": (lambda d, k, V: (np.zeros((d, k + 1), np.float32), np.zeros((d, k + 1), np.int32)), "k <= top_k"),
    "wrong type": (lambda d, k, V: "tokens please", "must return"),
    "triple": (lambda d, k, V: (1, 2, 3), "length 3"),
    "list not array": (lambda d, k, V: ([[0.0]], [[1]]), "numpy array"),
    "logits wrong V": (lambda d, k, V: np.zeros((d, V + 1), np.float32), "vocab_size"),
    "logits float64": (lambda d, k, V: np.zeros((d, V)), "float32"),
    "logits NaN": (lambda d, k, V: np.full((d, V), np.nan, np.float32), "NaN"),
}


@pytest.mark.parametrize("case", sorted(BAD_OUTPUTS))
def test_bad_drafter_output_raises_valueerror(toy_setup, case):
    tgt, _, V, ref = toy_setup
    make, pattern = BAD_OUTPUTS[case]
    with pytest.raises(ValueError, match=pattern):
        generate(tgt, PROMPT, 20, drafter=lambda ctx, depth, top_k: make(depth, top_k, V), tree_budget=8, depth=4,
                 top_k=4)
    assert np.array_equal(generate(tgt, PROMPT, 20, drafter=_ok, tree_budget=8, depth=4).tokens, ref[:20])


def test_context_is_a_zero_copy_readonly_view(toy_setup):
    tgt, _, V, ref = toy_setup
    seen = []

    def spy(ctx, depth, top_k):
        assert isinstance(ctx, np.ndarray) and ctx.dtype == np.int32 and ctx.ndim == 1
        assert not ctx.flags.writeable and not ctx.flags.owndata
        with pytest.raises(ValueError):
            ctx[0] = 1
        full = np.concatenate([PROMPT, ref])
        assert np.array_equal(ctx, full[:len(ctx)])
        seen.append((ctx.__array_interface__["data"][0], len(ctx)))
        return OracleDrafter(ref, 0.3, seed=len(seen), vocab_size=V, prompt_len=len(PROMPT)).draft(ctx, depth, top_k)

    res = generate(tgt, PROMPT, 40, drafter=spy, tree_budget=16, depth=4)
    assert np.array_equal(res.tokens, ref[:40])
    assert len(seen) > 3
    assert len({addr for addr, _ in seen}) == 1  # the same buffer every round, not a fresh copy
    assert seen[0][1] == len(PROMPT) + 1  # prompt + the first (root) token


def test_object_drafter_and_progress_streaming(toy_setup):
    tgt, _, V, ref = toy_setup
    chunks, counts = [], []

    def progress(new, done, total):
        chunks.append(np.array(new))
        counts.append((done, total))

    res = generate(tgt, PROMPT, 50, drafter=OracleDrafter(ref, 0.3, vocab_size=V), tree_budget=32, depth=6,
                   progress=progress)
    assert np.array_equal(np.concatenate(chunks), res.tokens)
    assert counts[-1] == (50, 50) and len(counts) == res.stats["rounds"] + 1
    check_stats(res, 6)
    assert res.stats["mean_acceptance_length"] > 1.5


def test_gil_released_during_native_work():
    tgt = toy(20000, 4096, seed=2)
    done = threading.Event()
    out = {}

    def work():
        out["res"] = generate(tgt, [1, 2, 3], 600)
        done.set()

    th = threading.Thread(target=work)
    counter = 0
    t0 = time.perf_counter()
    th.start()
    while not done.is_set():
        counter += 1
    th.join()
    elapsed = time.perf_counter() - t0
    assert len(out["res"].tokens) == 600
    # With the GIL held by the native loop this thread could not count at all meanwhile.
    assert elapsed > 0.02 and counter > 1000, (elapsed, counter)


# ---- random HF checkpoints (the real CPU model) ----------------------------------------------

@pytest.fixture(scope="module")
def hf_setup():
    try:
        from hf_models import cached_checkpoint
        if not hasattr(_native, "CpuModel"):
            pytest.skip("native CpuModel not built")
        tgt_dir = cached_checkpoint("ds3_base", seed=11)
        drf_dir = cached_checkpoint("tied_nonorm", seed=12)
    except ImportError as e:
        pytest.skip(f"needs torch + transformers: {e}")
    tgt = load_model(tgt_dir, 128)
    drf = load_model(drf_dir, 128)
    prompt = np.array([3, 17, 42, 99, 3, 17, 42, 8, 150, 3], dtype=np.int64)
    ar = generate(tgt, prompt, 28)
    return tgt, drf, prompt, ar.tokens


@pytest.mark.hf
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("depth", DEPTHS)
def test_lossless_hf(hf_setup, budget, depth):
    tgt, drf, prompt, ref = hf_setup
    V = 160
    for name, make in drafter_zoo(ref, V, len(prompt), drf).items():
        res = generate(tgt, prompt, len(ref), drafter=make(), tree_budget=budget, depth=depth)
        assert np.array_equal(res.tokens, ref), (name, budget, depth)
        check_stats(res, depth)


@pytest.mark.hf
def test_hf_ar_matches_transformers_greedy(hf_setup):
    tgt, _, prompt, ref = hf_setup
    from hf_models import cached_checkpoint, hf_greedy

    want = np.asarray(hf_greedy(cached_checkpoint("ds3_base", seed=11), prompt, 12)).reshape(-1)[-12:]
    assert np.array_equal(ref[:12], want)


@pytest.mark.hf
def test_hf_perfect_oracle(hf_setup):
    tgt, _, prompt, ref = hf_setup
    res = generate(tgt, prompt, 1 + 3 * 5, drafter=OracleDrafter(ref, vocab_size=160), tree_budget=16, depth=4)
    assert np.array_equal(res.tokens, ref[:16]) and res.stats["mean_acceptance_length"] == 5.0


class _FakeDeviceArray:
    """Claims to be a device array (__cuda_array_interface__) at a bogus address."""

    def __init__(self, shape, typestr):
        self.__cuda_array_interface__ = dict(shape=shape, typestr=typestr, data=(4096, False), version=3,
                                             strides=None, stream=None)


def test_device_array_draft_with_bad_pointer_is_a_clear_error(toy_setup):
    """A drafter returning a 'device array' that is not device memory: a clear exception (no
    crash), and the generator works afterwards (CPU-only builds: ValueError; CUDA builds:
    RuntimeError from the copy)."""
    target, ref = toy_setup[0], toy_setup[3]

    def fake(ctx, depth, top_k):
        return _FakeDeviceArray((1, 1), "<f4"), _FakeDeviceArray((1, 1), "<i4")

    with pytest.raises((RuntimeError, ValueError), match="device array"):
        generate(target, PROMPT, 8, drafter=fake)
    r = generate(target, PROMPT, 8, drafter=NgramDrafter())
    np.testing.assert_array_equal(r.tokens, ref[:8])


class _CAI:
    """An object whose __cuda_array_interface__ is whatever dict (or other value) it is given."""

    def __init__(self, cai):
        self.__cuda_array_interface__ = cai


def _cai(**kw):
    d = dict(shape=(2, 4), typestr="<f4", data=(4096, False), version=3)
    d.update(kw)
    return {k: v for k, v in d.items() if v is not _DROP}


_DROP = object()


@pytest.mark.parametrize("cai, match", [
    (_cai(typestr=_DROP), "the 'typestr' field is missing"),
    (_cai(shape=_DROP), "the 'shape' field is missing"),
    (_cai(data=_DROP), "the 'data' field is missing"),
    (_cai(typestr="zz"), "malformed __cuda_array_interface__"),
    (_cai(typestr=5), "malformed __cuda_array_interface__"),
    (_cai(shape=7), "malformed __cuda_array_interface__"),
    (_cai(data=(-5, False)), "malformed __cuda_array_interface__"),
    (_cai(data=(2**70, False)), "malformed __cuda_array_interface__"),
    (_cai(data=5), "malformed __cuda_array_interface__"),
    (_cai(strides=(4,)), "malformed __cuda_array_interface__"),
    (_cai(stream="s"), "malformed __cuda_array_interface__"),
    (_cai(stream=-3), "malformed __cuda_array_interface__"),
    ([1, 2], "__cuda_array_interface__ is not a dict"),
    (_cai(shape=(2**26, 4096)), r"shape \[67108864, 4096\] is larger than any draft"),
    (_cai(shape=(4, 10**6)), r"shape \[4, 1000000\] is larger than any draft"),
    (_cai(shape=(4,)), "must be 2-D, got a device array of shape"),
    (_cai(shape=(4, -1)), "negative extent"),
    (_cai(shape=(-1, -1)), "negative extent"),
])
def test_malformed_device_array_drafts_are_clear_errors(toy_setup, cai, match):
    """A producer's __cuda_array_interface__ that is malformed, or that declares an absurd shape,
    is a ValueError naming the drafter output (before any host buffer of that size is made, or
    any CUDA call); the generator works afterwards."""
    target, ref = toy_setup[0], toy_setup[3]
    with pytest.raises(ValueError, match=match):
        generate(target, PROMPT, 8, drafter=lambda c, d, k: _CAI(cai), tree_budget=8, depth=4)
    with pytest.raises(ValueError, match=match):
        generate(target, PROMPT, 8, drafter=lambda c, d, k: (_CAI(cai), _CAI(cai)), tree_budget=8, depth=4)
    np.testing.assert_array_equal(generate(target, PROMPT, 8, drafter=NgramDrafter()).tokens, ref[:8])


class _BadDLPackDevice:
    def __init__(self, dev):
        self.dev = dev

    def __dlpack_device__(self):
        return self.dev

    def __dlpack__(self, stream=None):
        return None


def test_malformed_dlpack_drafts_are_clear_errors(toy_setup):
    target, ref = toy_setup[0], toy_setup[3]
    for dev in (("a", "b"), (), 5):
        with pytest.raises(ValueError, match=r"__dlpack_device__\(\) (failed|is not)"):
            generate(target, PROMPT, 8, drafter=lambda c, d, k: _BadDLPackDevice(dev), tree_budget=8, depth=4)
    with pytest.raises(ValueError, match="DLPack export could not be read as a numpy array"):
        generate(target, PROMPT, 8, drafter=lambda c, d, k: _BadDLPackDevice((1, 0)), tree_budget=8, depth=4)
    torch = pytest.importorskip("torch")
    x = torch.zeros((2, target.vocab_size), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="DLPack export could not be read as a numpy array"):
        generate(target, PROMPT, 8, drafter=lambda c, d, k: x, tree_budget=8, depth=4)
    np.testing.assert_array_equal(generate(target, PROMPT, 8, drafter=NgramDrafter()).tokens, ref[:8])


class _RaisingCAI:
    @property
    def __cuda_array_interface__(self):
        raise Boom("the producer's own error")


def test_a_raising_cuda_array_interface_propagates(toy_setup):
    """A __cuda_array_interface__ property that raises something other than AttributeError: that
    exception, unchanged (it used to be swallowed and reported as 'drafter must return ...')."""
    target, ref = toy_setup[0], toy_setup[3]
    with pytest.raises(Boom, match="the producer's own error"):
        generate(target, PROMPT, 8, drafter=lambda c, d, k: _RaisingCAI(), tree_budget=8, depth=4)
    np.testing.assert_array_equal(generate(target, PROMPT, 8, drafter=NgramDrafter()).tokens, ref[:8])


def test_a_drafter_that_changes_the_target_cache_is_named(toy_setup):
    target, ref = toy_setup[0], toy_setup[3]

    def meddle(ctx, depth, top_k):
        target.reset()
        return None

    with pytest.raises(ValueError, match="cache changed during generate .* must not run prefill / reset"):
        generate(target, PROMPT, 8, drafter=meddle, tree_budget=8, depth=4)
    np.testing.assert_array_equal(generate(target, PROMPT, 8).tokens, ref[:8])


class _FakeDLPack:
    """Claims CUDA memory through DLPack (__dlpack_device__ -> (2, 0)) but exports a host array."""

    def __init__(self, a, raise_on_export=False):
        self.a, self.raise_on_export, self.exports = a, raise_on_export, 0

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):
        self.exports += 1
        if self.raise_on_export:
            raise BufferError("this producer cannot export")
        return self.a.__dlpack__()


def test_dlpack_draft_with_host_memory_or_a_raising_export_is_a_clear_error(toy_setup):
    """A DLPack 'CUDA' array that is really host memory: a clear exception naming the device array
    (CPU-only builds: ValueError; CUDA builds: RuntimeError from the copy's pointer check); a
    producer whose __dlpack__ raises: that exception, unchanged. The generator works afterwards
    and host rounds report no device drafts."""
    target, ref = toy_setup[0], toy_setup[3]
    lp = _FakeDLPack(np.zeros((1, 1), np.float32))
    ids = _FakeDLPack(np.zeros((1, 1), np.int32))
    with pytest.raises((RuntimeError, ValueError), match="device array"):
        generate(target, PROMPT, 8, drafter=lambda c, d, k: (lp, ids))
    assert lp.exports == 1
    with pytest.raises(BufferError, match="cannot export"):
        generate(target, PROMPT, 8, drafter=lambda c, d, k: _FakeDLPack(np.zeros((1, 160), np.float32), True))
    r = generate(target, PROMPT, 8, drafter=NgramDrafter())
    np.testing.assert_array_equal(r.tokens, ref[:8])
    assert r.stats["device_drafts"] == 0


def test_torch_cpu_tensors_as_drafts(toy_setup):
    """A drafter may return torch CPU tensors (read through DLPack as numpy views): both forms give
    exactly the numpy drafter's tokens and acceptance lengths; a float64 tensor is the float32
    ValueError of numpy output."""
    torch = pytest.importorskip("torch")
    target, ref = toy_setup[0], toy_setup[3]
    V = target.vocab_size
    orc_a, orc_b = OracleDrafter(ref, 0.3, seed=4, vocab_size=V), OracleDrafter(ref, 0.3, seed=4, vocab_size=V)

    def as_torch(ctx, depth, top_k):
        out = orc_b.draft(ctx, depth, top_k)
        return None if out is None else (torch.from_numpy(out[0]), torch.from_numpy(out[1].astype(np.int64)))

    a = generate(target, PROMPT, 30, drafter=orc_a, tree_budget=8, depth=4, top_k=3)
    b = generate(target, PROMPT, 30, drafter=as_torch, tree_budget=8, depth=4, top_k=3)
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_array_equal(b.acceptance_lengths, a.acceptance_lengths)
    np.testing.assert_array_equal(a.tokens, ref[:30])
    g = torch.Generator().manual_seed(1)
    logits = [torch.randn((4, V), generator=g) for _ in range(40)]
    calls = {"np": 0, "t": 0}

    def lg(kind):
        def fn(ctx, depth, top_k):
            x = logits[calls[kind] % 40][:depth]
            calls[kind] += 1
            return x.numpy() if kind == "np" else x
        return fn

    a = generate(target, PROMPT, 30, drafter=lg("np"), tree_budget=8, depth=4)
    b = generate(target, PROMPT, 30, drafter=lg("t"), tree_budget=8, depth=4)
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_array_equal(b.acceptance_lengths, a.acceptance_lengths)
    with pytest.raises(ValueError, match="float32"):
        generate(target, PROMPT, 8, drafter=lambda c, d, k: torch.zeros((d, V), dtype=torch.float64))


def test_rounds_option(toy_setup):
    """rounds="auto"/"host" run the host rounds for a host target; "device" needs a CudaModel;
    anything else is a ValueError. stats["rounds_on"] says where the rounds ran."""
    target, ref = toy_setup[0], toy_setup[3]
    for rounds in ("auto", "host"):
        r = generate(target, PROMPT, 12, drafter=NgramDrafter(), rounds=rounds)
        assert r.stats["rounds_on"] == "host"
        np.testing.assert_array_equal(r.tokens, ref[:12])
    with pytest.raises(ValueError, match="CudaModel"):
        generate(target, PROMPT, 4, rounds="device")
    with pytest.raises(ValueError, match="rounds"):
        generate(target, PROMPT, 4, rounds="gpu")
    r = generate(target, PROMPT, 12)
    np.testing.assert_array_equal(r.tokens, ref[:12])


# ---- one call at a time per native model (bindings/model_py.h ModelUse) ------------------------

def _native_engine(seed=5):
    """A CpuModel engine on random weights of the ds3_base config (no torch needed)."""
    from hf_models import config_dict, random_weights
    from kdtree_native.config import config_from_dict
    cfg = config_from_dict(config_dict("ds3_base"))
    return kn.Engine.from_weights(cfg, random_weights(cfg, seed), device="cpu", max_seq_len=512)


def test_calls_into_a_model_during_its_generate_are_refused():
    """A drafter or progress callback that calls the target's forward / commit / truncate / reset during its
    generate gets a RuntimeError naming the busy model (before, they ran and overwrote the round's pending cache
    entries); the generate raises it, and the engine generates the AR answer afterwards."""
    eng = _native_engine()
    prompt = np.array([3, 17, 42, 99, 3, 17, 42, 8], np.int64)
    ref = eng.generate(prompt, 24).tokens
    calls = {
        "forward": lambda: eng.forward(np.array([1]), np.array([eng.cache_len])),
        "commit": lambda: eng.commit([0]),
        "truncate": lambda: eng.truncate(1),
        "reset": lambda: eng.reset(),
        "prefill": lambda: eng.prefill(prompt),
    }
    for name, call in calls.items():
        def drafter(ctx, depth, top_k, call=call):
            call()
            return None

        with pytest.raises(RuntimeError, match="busy with generate"):
            eng.generate(prompt, 24, drafter=drafter, tree_budget=8, depth=4)
        with pytest.raises(RuntimeError, match="busy with generate"):
            eng.generate(prompt, 24, progress=lambda new, done, total, call=call: call())
        np.testing.assert_array_equal(eng.generate(prompt, 24, drafter=NgramDrafter(), tree_budget=8, depth=4).tokens,
                                      ref, err_msg=name)


def test_concurrent_calls_on_one_engine_never_corrupt_a_generate():
    """One thread generates (AR and n-gram DDTree) while another calls forward / commit / reset on the same engine:
    each of those either runs between the generates or raises RuntimeError (the model is busy), and every
    generate returns the AR answer (before, the interleaved calls gave wrong tokens without an error)."""
    eng = _native_engine()
    prompt = np.array([5, 9, 11, 5, 9, 13, 2, 7], np.int64)
    ref = eng.generate(prompt, 120).tokens
    outs, errors, stop = [], [], threading.Event()

    def gen():
        try:
            for i in range(4):
                dr = NgramDrafter() if i % 2 else None
                outs.append(eng.generate(prompt, 120, drafter=dr, tree_budget=4, depth=4).tokens)
        except Exception as e:  # (asserted below: no generate may fail)
            outs.append(e)
        finally:
            stop.set()

    def meddle():
        while not stop.is_set():
            for call in (lambda: eng.forward(np.array([1, 2]), np.array([0, 1])), lambda: eng.commit([0]),
                         lambda: eng.reset()):
                try:
                    call()
                except RuntimeError as e:
                    errors.append(str(e))
                except ValueError:  # a commit with nothing pending, when it ran between the generates
                    pass
            time.sleep(0.0005)

    threads = [threading.Thread(target=gen), threading.Thread(target=meddle)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outs) == 4 and not any(isinstance(o, Exception) for o in outs), outs
    for out in outs:
        np.testing.assert_array_equal(out, ref)
    assert all("busy" in e for e in errors), errors[:3]


def test_two_generates_may_share_one_model_drafter():
    """Two engines generating at once from two threads with one native ModelDrafter (one draft engine): the draft
    calls take turns on the draft model (a ModelDrafter re-syncs its cache at every call), so both give their AR
    answers and neither raises."""
    engines = [_native_engine(), _native_engine()]
    draft = ModelDrafter(_native_engine(seed=6))
    prompts = [np.array([5, 9, 11, 5, 9, 13, 2, 7], np.int64), np.array([1, 2, 3, 1, 2, 4, 8], np.int64)]
    refs = [e.generate(p, 80).tokens for e, p in zip(engines, prompts)]
    results, errors = [[], []], []

    def run(i):
        try:
            for _ in range(3):
                results[i].append(engines[i].generate(prompts[i], 80, drafter=draft, tree_budget=4, depth=4).tokens)
        except Exception as e:  # (asserted below: none)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        assert len(results[i]) == 3
        for out in results[i]:
            np.testing.assert_array_equal(out, refs[i])
