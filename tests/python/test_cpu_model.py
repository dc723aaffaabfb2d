"""The C++ CPU target model (cpp/model/) through kn.Engine / _native.CpuModel:

* HF parity on every PARITY_CONFIG: prefill logits vs HF eager fp32 (1e-4 of the logits'
  scale) and 24 greedy tokens by incremental decode (T=1 forward + commit) == HF's (marked hf,
  skipped without torch / transformers);
* the NumPy reference (float64) on prefill, decode, tree verify and the latent cache itself
  (1e-5 relative; no torch needed);
* tree consistency: verify logits of every node of a random tree == decoding its root-to-node
  path one token at a time; after commit(path) the cache and the next decode equal plain AR;
* both SGEMM paths (CBLAS when built, the portable kernel always) against NumPy;
* input validation: every bad argument is a ValueError naming the problem.
"""
import os
import threading

import numpy as np
import pytest

import kdtree_native as kn
from kdtree_native import _native
from kdtree_native.checkpoint import expected_weight_shapes
from kdtree_native.config import config_from_dict
from kdtree_native.reference import ReferenceModel

from hf_models import PARITY_CONFIGS, cached_checkpoint, config_dict, hf_greedy, hf_logits, random_weights, to_bf16
from tree_cases import ddtree_vs_ar_mismatches, path_to, random_tree, tree_rows_against_ar_steps

NAMES = list(PARITY_CONFIGS)


def rel_to_scale(a, b):
    """max |a - b| relative to the logits' scale (max |b|)."""
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def prompt(vocab, n, seed):
    return np.random.default_rng(seed).integers(0, vocab, n)


_ENGINES = {}


def numpy_engine(name, seed=0, max_seq_len=256):
    """(engine, reference model, cfg) on the same random weights (no torch)."""
    key = (name, seed, max_seq_len)
    if key not in _ENGINES:
        cfg = config_from_dict(config_dict(name))
        w = random_weights(cfg, seed)
        _ENGINES[key] = (kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=max_seq_len),
                         ReferenceModel(cfg, w), cfg)
    eng, ref, cfg = _ENGINES[key]
    eng.reset()
    ref.reset()
    return eng, ref, cfg


def greedy_incremental(eng, ids, n):
    """Prefill, then n greedy tokens by T=1 forwards + commit."""
    logits = eng.prefill(ids)
    out = []
    nxt = int(np.argmax(logits[-1]))
    for _ in range(n):
        out.append(nxt)
        pos = eng.cache_len
        lg = eng.forward(np.array([nxt]), np.array([pos]))
        eng.commit([0])
        nxt = int(np.argmax(lg[0]))
    return np.array(out)


# ---- weights / config plumbing ------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_weight_specs_match_checkpoint_loader(name):
    cfg = config_from_dict(config_dict(name))
    native = {n: tuple(s) for n, s in _native.model_weight_specs(cfg.to_native())}
    assert native == {n: tuple(s) for n, s in expected_weight_shapes(cfg).items()}


# ---- HF parity ------------------------------------------------------------------------------

@pytest.mark.hf
@pytest.mark.parametrize("name", NAMES)
def test_prefill_logits_match_hf(name):
    path = cached_checkpoint(name)
    eng = kn.Engine.from_pretrained(path, device="cpu", max_seq_len=128)
    assert eng.device == "cpu" and eng.config.vocab_size == config_dict(name)["vocab_size"]
    ids = prompt(eng.config.vocab_size, 37, seed=len(name))
    logits = eng.prefill(ids)
    assert logits.dtype == np.float32 and logits.shape == (37, eng.config.vocab_size)
    assert eng.cache_len == 37
    hf = hf_logits(path, ids)
    assert rel_to_scale(logits, hf) < 1e-4


@pytest.mark.hf
@pytest.mark.parametrize("name", NAMES)
def test_greedy_24_matches_hf(name):
    path = cached_checkpoint(name)
    eng = kn.Engine.from_pretrained(path, device="cpu", max_seq_len=64)
    ids = prompt(eng.config.vocab_size, 9, seed=100 + len(name))
    ours = greedy_incremental(eng, ids, 24)
    theirs = hf_greedy(path, ids, 24)
    assert ours.tolist() == theirs.tolist(), f"{int((ours == theirs).sum())}/24 tokens agree"
    assert eng.cache_len == 9 + 24


# ---- NumPy reference ------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_prefill_decode_match_reference(name):
    eng, ref, cfg = numpy_engine(name)
    ids = prompt(cfg.vocab_size, 23, seed=1)
    assert rel_to_scale(eng.prefill(ids), ref.forward(ids)) < 1e-5
    for k, tok in enumerate(prompt(cfg.vocab_size, 5, seed=2)):
        pos = 23 + k
        ours = eng.forward([tok], [pos])
        eng.commit([0])
        assert rel_to_scale(ours, ref.forward([tok], [pos])) < 1e-5
    # The latent cache itself: normed latent + roped k_rope per token, every layer.
    C = cfg.kv_lora_rank
    for layer in range(cfg.num_hidden_layers):
        rows = eng.model.read_cache(layer, 0, eng.cache_len)
        np.testing.assert_allclose(rows[:, :C], ref.kv_latent[layer], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(rows[:, C:], ref.k_rope[layer], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["ds3_base", "neox_yarn_groups", "no_q_lora", "kimi_like"])
def test_tree_verify_and_compaction_match_reference(name):
    eng, ref, cfg = numpy_engine(name)
    ids = prompt(cfg.vocab_size, 11, seed=3)
    eng.prefill(ids)
    ref.forward(ids)
    parents, depths, vis = random_tree(17, seed=4)
    toks = prompt(cfg.vocab_size, 17, seed=5)
    pos = 11 + depths
    assert rel_to_scale(eng.forward(toks, pos, vis), ref.forward(toks, pos, vis)) < 1e-5
    keep = path_to(parents, 16)
    eng.commit(keep)
    ref.compact(keep)
    assert eng.cache_len == ref.cache_len == 11 + len(keep)
    nxt = [int(toks[0])]
    p = [eng.cache_len]
    assert rel_to_scale(eng.forward(nxt, p), ref.forward(nxt, p)) < 1e-5


# ---- tree consistency -----------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_tree_nodes_equal_sequential_decode(name):
    eng, _, cfg = numpy_engine(name)
    V = cfg.vocab_size
    ids = prompt(V, 10, seed=6)
    n = 21
    parents, depths, vis = random_tree(n, seed=7 + len(name))
    toks = prompt(V, n, seed=8)
    eng.prefill(ids)
    L = eng.cache_len
    tree_logits = eng.forward(toks, L + depths, vis)
    assert eng.cache_len == L and eng.model.pending_len == n
    for i in range(n):
        path = path_to(parents, i)
        eng.prefill(ids)
        for t in toks[path]:
            last = eng.decode(int(t))
        assert rel_to_scale(tree_logits[i], last) < 1e-5, f"node {i} (depth {depths[i]})"

    # Compaction: keep a root-to-leaf path; the cache and the next decode == plain AR.
    leaf = int(np.argmax(depths))
    path = path_to(parents, leaf)
    eng.prefill(ids)
    eng.forward(toks, L + depths, vis)
    eng.commit(path)
    assert eng.cache_len == L + len(path)
    after_tree = eng.decode(int(toks[0]))
    cache_tree = [eng.model.read_cache(l, 0, eng.cache_len) for l in range(cfg.num_hidden_layers)]
    ar = eng.prefill(np.concatenate([ids, toks[path], toks[:1]]))
    assert rel_to_scale(after_tree, ar[-1]) < 1e-5
    for l in range(cfg.num_hidden_layers):
        np.testing.assert_allclose(cache_tree[l], eng.model.read_cache(l, 0, eng.cache_len), rtol=1e-5, atol=1e-5)


def test_tree_rows_are_the_ar_steps_bits(skinny_isa):
    """A tree node's logits and cache row are the same bits as the one-token AR steps along its path
    (CpuModel::kRowExactWindow): what makes DDTree emit AR's tokens in a near tie and a seeded sample
    land on the same token. Until the sixty-first session they agreed to ~4e-7 only (on the embedded
    model 228 of 231 tree nodes differed from their AR steps; the fuzz found a sampled token flipping):
    a skinny-kernel column outside the 4-column tiles summed its lanes in another order (the scores'
    column count is the cache plus the window), the softmax's tail took std::exp and its lanes went
    by position in the window (a tree's masked siblings moved them), and long contexts sent the
    scores to BLAS. Random trees at several cache lengths (every residue of the lanes), on a random
    parity model and the embedded one, with one case past the old BLAS border (Sc x (C + R) > 2^18
    floats with more than 128 query rows), and trees of more than 128 nodes (until the sixty-second
    session every node of those differed: windows past 128 tokens took BLAS, tree or not)."""
    cases = [(numpy_engine("kimi_like", max_seq_len=256)[0], L, n) for L, n in ((5, 9), (12, 14), (37, 21))]
    try:
        emb = kn.Engine.from_pretrained(kn.default_model_dir(), device="cpu", max_seq_len=2048)
        cases += [(emb, L, n) for L, n in ((1, 6), (30, 12), (61, 17), (200, 24))] + [(emb, 1700, 20)]
        cases += [(emb, 5, 150), (emb, 300, 260)]
    except FileNotFoundError:
        pass
    for k, (eng, L, n) in enumerate(cases):
        V = eng.vocab_size
        parents, depths, vis = random_tree(n, seed=40 + k)
        differ, same_cache = tree_rows_against_ar_steps(eng, prompt(V, L, seed=50 + k), prompt(V, n, seed=60 + k),
                                                         parents, depths, vis)
        assert differ == [] and same_cache, (k, L, n, differ, same_cache)


def test_seeded_samples_of_ddtree_are_ar_tokens_on_the_embedded_model():
    """End to end on a real model: with the same seed, DDTree emits AR's sampled tokens (T = 0.7 / 1 with
    top-p, every built-in drafter kind, fixed and adaptive budgets up to 64 nodes), as docs/ENGINE.md
    "Sampling" promises where the rows are exact (test_tree_rows_are_the_ar_steps_bits)."""
    try:
        eng = kn.Engine.from_pretrained(kn.default_model_dir(), device="cpu", max_seq_len=512)
        draft = kn.Engine.from_pretrained(kn.default_draft_dir(), device="cpu", max_seq_len=512)
    except FileNotFoundError:
        pytest.skip("the embedded default models are not installed")
    text = kn.models.heldout_sample()[3]["text"]
    ids = np.array([ord(c) % eng.vocab_size for c in text[:300]], dtype=np.int32)  # any ids will do
    assert ddtree_vs_ar_mismatches(eng, draft, ids, ((1, 1.0, 1.0), (2, 0.7, 0.9), (3, 1.0, 0.9))) == []


def test_sgemm_columns_do_not_depend_on_n(skinny_isa):
    """Each output of the trans_b skinny kernels is the same bits whatever N is: the columns past the last
    4-column tile (N % 4 of them) used to sum their lanes in another order than a tile's (columns
    128-130 of N = 131 differed from the same columns of N = 132), and whatever M is (1 row: 8-column
    tiles; 2-13 rows: every remainder of the row tiles)."""
    rng = np.random.default_rng(3)
    for K in (16, 40, 160):
        b = rng.standard_normal((140, K)).astype(np.float32)
        a = rng.standard_normal((13, K)).astype(np.float32)
        ref = _native.sgemm(a[:1], b[:129], trans_b=True)
        for N in range(120, 140):
            for M in (1, 2, 3, 5, 7, 13):
                got = _native.sgemm(a[:M], b[:N], trans_b=True)
                n = min(N, 129)
                assert np.array_equal(got[0, :n], ref[0, :n]), (K, N, M)
                assert np.array_equal(got[:, :n], _native.sgemm(a[:M], b[:140], trans_b=True)[:, :n]), (K, N, M)


def test_uncommitted_forward_is_overwritten_and_uint8_mask_equals_bool():
    eng, _, cfg = numpy_engine("ds3_base")
    ids = prompt(cfg.vocab_size, 8, seed=9)
    eng.prefill(ids)
    parents, depths, vis = random_tree(9, seed=10)
    toks = prompt(cfg.vocab_size, 9, seed=11)
    a = eng.forward(toks, 8 + depths, vis)
    eng.forward(prompt(cfg.vocab_size, 5, seed=12), 8 + np.arange(5))     # dropped window
    b = eng.forward(toks, 8 + depths, vis.astype(np.uint8))
    np.testing.assert_array_equal(a, b)
    eng.commit([])                     # keep nothing: cache unchanged
    assert eng.cache_len == 8
    # a causal visibility matrix == visibility None
    c = eng.forward(toks, 8 + np.arange(9), np.tril(np.ones((9, 9), bool)))
    d = eng.forward(toks, 8 + np.arange(9), None)
    np.testing.assert_array_equal(c, d)


def test_long_prefill_chunks_attention():
    """A prompt long enough that attention runs in several query chunks equals decode."""
    cfg = config_from_dict(config_dict(dict(num_attention_heads=16, num_key_value_heads=16)))
    w = random_weights(cfg, 0)
    eng = kn.Engine.from_weights(cfg, w, max_seq_len=700)
    ids = prompt(cfg.vocab_size, 600, seed=13)
    full = eng.prefill(ids)
    eng.prefill(ids[:-3])
    for k in range(3):
        last = eng.decode(int(ids[597 + k]))
        assert rel_to_scale(last, full[597 + k]) < 1e-5


def test_forward_last_gives_the_last_rows():
    """forward_last(tokens, positions, rows): the last `rows` rows of forward()'s logits, bit for bit
    (the LM head takes the skinny kernels at these sizes, whose rows do not depend on how many there
    are), and the same cache entries: a commit and a decode after it give what they give after
    forward(). rows = 0 gives none; rows outside [0, T] is a ValueError."""
    cfg = config_from_dict(config_dict("ds3_base"))
    eng = kn.Engine.from_weights(cfg, random_weights(cfg, 0), max_seq_len=256)
    m = eng.model
    ids = prompt(cfg.vocab_size, 40, seed=3)
    pos = np.arange(40)
    full = m.forward(ids, pos)
    for rows in (0, 1, 3, 40):
        eng.reset()
        got = m.forward_last(ids, pos, rows)
        assert got.shape == (rows, cfg.vocab_size)
        np.testing.assert_array_equal(got, full[40 - rows:])
    parents, depths, vis = random_tree(9, seed=4)
    toks = prompt(cfg.vocab_size, 9, seed=5)
    eng.reset()
    m.forward(ids, pos)
    m.commit(np.arange(40))
    tree = m.forward(toks, 40 + depths, vis)
    eng.reset()
    m.forward_last(ids, pos, 1)
    m.commit(np.arange(40))
    np.testing.assert_array_equal(m.forward_last(toks, 40 + depths, 2, vis), tree[-2:])
    for bad in (-1, 10):
        with pytest.raises(ValueError, match="rows"):
            m.forward_last(toks, 40 + depths, bad, vis)


@pytest.mark.parametrize("chunk", [7, 64, 512])
def test_generate_prefill_in_chunks_equals_greedy(chunk):
    """generate's prefill asks the model for its last token's logits only (earlier chunks for none):
    over a 150-token prompt in chunks of 7 / 64 / 512 the tokens are the greedy ones of a full prefill
    and T = 1 decodes."""
    cfg = config_from_dict(config_dict("ds3_base"))
    eng = kn.Engine.from_weights(cfg, random_weights(cfg, 1), max_seq_len=256)
    ids = prompt(cfg.vocab_size, 150, seed=6)
    want = greedy_incremental(eng, ids, 12)
    got = eng.generate(ids, 12, prefill_chunk=chunk)
    np.testing.assert_array_equal(got.tokens, want)


# ---- SGEMM ----------------------------------------------------------------------------------

@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("mnk", [(1, 1, 1), (1, 257, 63), (3, 17, 5), (4, 33, 300), (5, 16, 16),
                                 (17, 63, 257), (130, 70, 513), (257, 31, 1)])
def test_sgemm_matches_numpy(portable, trans_b, mnk):
    M, N, K = mnk
    rng = np.random.default_rng(M * 1000 + N * 10 + K)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if trans_b else (K, N)).astype(np.float32)
    c = rng.standard_normal((M, N)).astype(np.float32)
    bb = b.T if trans_b else b
    want = a.astype(np.float64) @ bb.astype(np.float64)
    got = _native.sgemm(a, b, trans_b=trans_b, portable=portable)
    tol = 1e-5 * np.sqrt(K) * max(1.0, np.abs(want).max())
    assert np.abs(got - want).max() < tol
    got = _native.sgemm(a, b, trans_b=trans_b, alpha=0.5, beta=-2.0, c=c, portable=portable)
    assert np.abs(got - (0.5 * want - 2.0 * c)).max() < tol * 2


ISA0 = _native.sgemm_skinny_isa()  # this CPU's default for the skinny kernels


@pytest.fixture(params=["avx2", "avx512"])
def skinny_isa(request):
    """Each vector ISA of the CPU skinny kernels in turn (skipped where the CPU lacks it); the
    default is restored afterwards."""
    if not _native.sgemm_set_skinny_isa(request.param):
        _native.sgemm_set_skinny_isa(ISA0) if ISA0 != "none" else None
        pytest.skip(f"this CPU has no {request.param} skinny kernels")
    assert _native.sgemm_skinny_isa() == request.param
    yield request.param
    if ISA0 != "none":
        _native.sgemm_set_skinny_isa(ISA0)


def test_sgemm_skinny_shapes(skinny_isa):
    """The trans_b skinny kernels (the model's projections) for every row count from 1 to 13 and
    a few larger (AVX2 tiles of 3 rows x 4 weight rows, AVX-512 5 x 4: every remainder), column
    counts around the 4-row passes and k around the vector widths (8 / 16 floats: the scalar
    tail), strided operands, alpha / beta: within 1e-5 sqrt(K) of the float64 product."""
    rng = np.random.default_rng(7)
    for M in list(range(1, 14)) + [17, 20, 21, 48, 130]:
        for N, K in ((1, 1), (3, 15), (4, 16), (5, 17), (9, 33), (33, 320), (70, 100)):
            a = rng.standard_normal((M, K + 3)).astype(np.float32)[:, :K]
            b = rng.standard_normal((N, K)).astype(np.float32)
            c = rng.standard_normal((M, N)).astype(np.float32)
            want = a.astype(np.float64) @ b.astype(np.float64).T
            tol = 1e-5 * np.sqrt(K) * max(1.0, np.abs(want).max())
            got = _native.sgemm(np.ascontiguousarray(a), b, trans_b=True)
            assert np.abs(got - want).max() < tol, (M, N, K)
            got = _native.sgemm(np.ascontiguousarray(a), b, trans_b=True, alpha=0.5, beta=-2.0, c=c)
            assert np.abs(got - (0.5 * want - 2.0 * c)).max() < 2 * tol, (M, N, K)


def test_sgemm_nn_same_bits_on_each_isa():
    """The skinny kernels with B not transposed (the attention's absorption and P @ latent): an FMA
    chain per output in k order in every vector tile, so AVX-512's 32-column tiles, AVX2's
    16-column ones and their mix give the same bits; within 1e-5 sqrt(K) of float64. Rows 1-13
    and 20 (6-row tiles and every remainder), column counts around 16 and 32, alpha / beta."""
    if ISA0 == "none":
        pytest.skip("no skinny kernels on this CPU")
    isas = [i for i in ("avx2", "avx512") if _native.sgemm_set_skinny_isa(i)]
    rng = np.random.default_rng(8)
    try:
        for M in list(range(1, 14)) + [20]:
            for N in (15, 16, 17, 32, 48, 64, 80, 100):
                for K in (1, 7, 64):
                    a = rng.standard_normal((M, K)).astype(np.float32)
                    b = rng.standard_normal((K, N)).astype(np.float32)
                    c = rng.standard_normal((M, N)).astype(np.float32)
                    want = a.astype(np.float64) @ b.astype(np.float64)
                    outs = []
                    for isa in isas:
                        assert _native.sgemm_set_skinny_isa(isa)
                        outs.append((_native.sgemm(a, b), _native.sgemm(a, b, alpha=0.5, beta=-2.0, c=c)))
                    tol = 1e-5 * np.sqrt(K) * max(1.0, np.abs(want).max())
                    assert np.abs(outs[0][0] - want).max() < tol, (M, N, K)
                    assert np.abs(outs[0][1] - (0.5 * want - 2.0 * c)).max() < 2 * tol, (M, N, K)
                    for o in outs[1:]:
                        assert np.array_equal(o[0], outs[0][0]) and np.array_equal(o[1], outs[0][1]), (M, N, K)
    finally:
        _native.sgemm_set_skinny_isa(ISA0)


@pytest.mark.parametrize("name", ["ds3_base", "kimi_like"])
def test_model_matches_reference_with_each_skinny_isa(skinny_isa, name):
    """Prefill, decode and a 17-node tree verify against the NumPy reference with the AVX2 and the
    AVX-512 skinny kernels (the model runs whichever the CPU has; both are checked here)."""
    eng, ref, cfg = numpy_engine(name)
    ids = prompt(cfg.vocab_size, 11, seed=3)
    assert rel_to_scale(eng.prefill(ids), ref.forward(ids)) < 1e-5
    parents, depths, vis = random_tree(17, seed=4)
    toks = prompt(cfg.vocab_size, 17, seed=5)
    assert rel_to_scale(eng.forward(toks, 11 + depths, vis), ref.forward(toks, 11 + depths, vis)) < 1e-5
    eng.commit([])
    ref.compact([])
    for T in (1, 2, 5, 9):
        t = prompt(cfg.vocab_size, T, seed=6 + T)
        assert rel_to_scale(eng.forward(t, 11 + np.arange(T)), ref.forward(t, 11 + np.arange(T))) < 1e-5, T
        eng.commit([])
        ref.compact([])


def test_sgemm_backend_reported():
    assert _native.sgemm_backend() in ("cblas", "portable")
    assert kn.build_info()["cpu_blas"].startswith(_native.sgemm_backend())


# ---- validation -----------------------------------------------------------------------------

def test_forward_validation_errors():
    eng, _, cfg = numpy_engine("ds3_base", max_seq_len=32)
    m, V = eng.model, cfg.vocab_size
    with pytest.raises(ValueError, match="token id|tokens"):
        m.forward([V], [0])
    with pytest.raises(ValueError, match="tokens"):
        m.forward([-1], [0])
    with pytest.raises(ValueError, match="integer dtype"):
        m.forward(np.array([1.0]), [0])
    with pytest.raises(ValueError, match="empty"):
        m.forward(np.array([], np.int64), np.array([], np.int64))
    with pytest.raises(ValueError, match="positions"):
        m.forward([1], [-1])
    with pytest.raises(ValueError, match="positions: length"):
        m.forward([1, 2], [0])
    with pytest.raises(ValueError, match="1-D"):
        m.forward(np.ones((2, 2), np.int64), [0, 1])
    with pytest.raises(ValueError, match="visibility: expected shape"):
        m.forward([1, 2], [0, 1], np.ones((3, 3), bool))
    with pytest.raises(ValueError, match="visibility: expected dtype"):
        m.forward([1, 2], [0, 1], np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match="max_seq_len"):
        m.forward(np.zeros(33, np.int64), np.arange(33))
    eng.prefill(np.zeros(30, np.int64))
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.forward(np.zeros(3, np.int64), 30 + np.arange(3))
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.prefill(np.zeros(33, np.int64))
    assert eng.cache_len == 30        # a refused call leaves the cache alone
    eng.forward([1, 2], [30, 31])     # exactly full is fine
    eng.commit([0, 1])
    assert eng.cache_len == 32
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.decode(1)


def test_commit_validation_errors():
    eng, _, cfg = numpy_engine("ds3_base", max_seq_len=32)
    eng.prefill([1, 2, 3])
    with pytest.raises(ValueError, match="pending"):
        eng.commit([0])               # nothing pending after prefill's commit
    eng.forward([4, 5, 6], [3, 4, 5])
    with pytest.raises(ValueError, match="strictly increasing"):
        eng.commit([1, 1])
    with pytest.raises(ValueError, match="strictly increasing"):
        eng.commit([2, 0])
    with pytest.raises(ValueError, match="keep"):
        eng.commit([3])
    with pytest.raises(ValueError, match="keep"):
        eng.commit([-1])
    with pytest.raises(ValueError, match="integer"):
        eng.commit(np.array([0.0]))
    assert eng.cache_len == 3
    eng.commit([0, 2])
    assert eng.cache_len == 5


def test_truncate_rolls_back_the_cache():
    """truncate(n) keeps the first n committed entries: decoding on from there equals a fresh
    prefill of the same tokens; the pending window is dropped; bad lengths are refused."""
    eng, ref, cfg = numpy_engine("ds3_base", max_seq_len=64)
    ids = prompt(cfg.vocab_size, 12, seed=21)
    eng.prefill(ids)
    eng.forward(prompt(cfg.vocab_size, 3, seed=22), 12 + np.arange(3))  # pending, dropped by truncate
    eng.truncate(7)
    assert eng.cache_len == 7 and eng.model.pending_len == 0
    with pytest.raises(ValueError, match="pending"):
        eng.commit([0])
    other = prompt(cfg.vocab_size, 4, seed=23)
    got = eng.forward(other, 7 + np.arange(4))
    eng.commit(np.arange(4))
    want = eng.prefill(np.concatenate([ids[:7], other]))[7:]
    assert rel_to_scale(got, want) < 1e-6
    eng.truncate(eng.cache_len)        # a no-op
    assert eng.cache_len == 11
    for bad in (-1, 12):
        with pytest.raises(ValueError, match="truncate"):
            eng.truncate(bad)
    with pytest.raises(ValueError, match="integer"):
        eng.truncate(1.5)
    assert eng.cache_len == 11
    eng.truncate(0)
    assert eng.cache_len == 0
    np.testing.assert_array_equal(eng.forward(ids[:3], np.arange(3)), eng.prefill(ids[:3]))


def test_weight_and_config_validation_errors():
    cfg = config_from_dict(config_dict("ds3_base"))
    w = random_weights(cfg, 0)
    m = _native.CpuModel(cfg.to_native(), 16)
    with pytest.raises(ValueError, match="not finalized"):
        m.forward([1], [0])
    with pytest.raises(ValueError, match="float32"):
        m.set_weight("model.norm.weight", w["model.norm.weight"])          # float64
    with pytest.raises(ValueError, match=r"shape \[47\].*\[48\]"):
        m.set_weight("model.norm.weight", np.ones(47, np.float32))
    with pytest.raises(ValueError, match="unexpected tensor"):
        m.set_weight("model.layers.9.mlp.gate.weight", np.ones((8, 48), np.float32))
    # a non-finite weight is refused, naming the tensor and the first bad index (any NaN payload,
    # either infinity, in the vectorised part or a block's tail); check_finite=False takes it
    for pos, val, what in ((0, np.nan, "NaN"), (47, -np.inf, "an infinity"), (1030, np.inf, "an infinity"),
                           (1100, -np.float32(np.nan), "NaN")):
        a = w["model.layers.1.mlp.experts.3.up_proj.weight"].astype(np.float32)
        flat = a.reshape(-1)
        if pos >= flat.size:
            continue
        flat[pos] = val
        flat[-1] = np.inf  # a later one: the first is named
        with pytest.raises(ValueError, match=rf"'model.layers.1.mlp.experts.3.up_proj.weight' holds {what} at flat index {pos} "):
            m.set_weight("model.layers.1.mlp.experts.3.up_proj.weight", a)
    for name, arr in w.items():
        if name != "model.layers.1.mlp.experts.3.up_proj.weight":
            m.set_weight(name, arr.astype(np.float32))
    with pytest.raises(ValueError, match=r"missing: model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        m.finalize()
    assert m.missing_weights() == ["model.layers.1.mlp.experts.3.up_proj.weight"]
    # non-contiguous float32 input is accepted (copied)
    big = np.asfortranarray(w["model.layers.1.mlp.experts.3.up_proj.weight"].astype(np.float32))
    m.set_weight("model.layers.1.mlp.experts.3.up_proj.weight", big)
    m.finalize()
    assert m.finalized and m.missing_weights() == []
    with pytest.raises(ValueError, match="max_seq_len"):
        _native.CpuModel(cfg.to_native(), 0)
    bad = cfg.to_native()
    del bad["softmax_scale"]
    with pytest.raises(ValueError, match="softmax_scale"):
        _native.CpuModel(bad, 16)
    bad = cfg.to_native()
    bad["rope_inv_freq"] = bad["rope_inv_freq"][:-1]
    with pytest.raises(ValueError, match="rope_inv_freq"):
        _native.CpuModel(bad, 16)
    bad = cfg.to_native()
    bad["hidden_size"] = 1.5
    with pytest.raises(ValueError, match="hidden_size"):
        _native.CpuModel(bad, 16)


def test_forward_releases_the_gil():
    """While a long forward runs in another thread, this thread keeps running Python: the
    longest pause it sees is far shorter than the forward (it would span the whole call if the
    GIL were held). Two engines running concurrently also agree."""
    import time

    cfg = config_from_dict(config_dict(dict(num_attention_heads=8, num_key_value_heads=8)))
    w = random_weights(cfg, 0)
    engines = [kn.Engine.from_weights(cfg, w, max_seq_len=800) for _ in range(2)]
    ids = prompt(cfg.vocab_size, 768, seed=14)
    results, spans = [None, None], [None, None]

    def work(k):
        t0 = time.perf_counter()
        results[k] = engines[k].prefill(ids)
        spans[k] = time.perf_counter() - t0

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    last, gap = time.perf_counter(), 0.0
    while any(t.is_alive() for t in threads):
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    for t in threads:
        t.join()
    np.testing.assert_array_equal(results[0], results[1])
    if min(spans) < 0.05:
        pytest.skip(f"forward too fast ({min(spans) * 1e3:.0f} ms) to tell")
    assert gap < 0.5 * min(spans), f"main thread paused {gap * 1e3:.0f} ms during {min(spans) * 1e3:.0f} ms forwards"


@pytest.mark.parametrize("name", ["ds3_base", "neox_many_groups"])
def test_portable_sgemm_through_the_model(name):
    """The whole forward on the portable SGEMM (forced even in a CBLAS build) == reference."""
    eng, ref, cfg = numpy_engine(name)
    ids = prompt(cfg.vocab_size, 19, seed=15)
    parents, depths, vis = random_tree(9, seed=16)
    toks = prompt(cfg.vocab_size, 9, seed=17)
    _native.sgemm_force_portable(True)
    try:
        assert _native.sgemm_backend() == "portable"
        assert rel_to_scale(eng.prefill(ids), ref.forward(ids)) < 1e-5
        assert rel_to_scale(eng.forward(toks, 19 + depths, vis), ref.forward(toks, 19 + depths, vis)) < 1e-5
    finally:
        _native.sgemm_force_portable(False)


def _bf16_exact(w):
    """The same tensors rounded to BF16 values (kept as float64): what a BF16 checkpoint loads as."""
    return {k: to_bf16(v).astype(np.float64) for k, v in w.items()}


MODES = ("only", "copies", "off")


def _weight_elements(cfg, embed_is_gemm):
    """(elements of the weight matrices the CPU model may hold as BF16, of its untied embedding)."""
    shapes = expected_weight_shapes(cfg)
    vectors = ("layernorm.weight", "model.norm.weight", "e_score_correction_bias")
    n = sum(int(np.prod(s)) for k, s in shapes.items() if not k.endswith(vectors))
    embed = cfg.vocab_size * cfg.hidden_size
    return n, 0 if embed_is_gemm else embed


def _run_model(eng, cfg, long_prefill=0):
    """Logits of a prefill, tree verifies of 1..33 tokens with commits, and (long_prefill > 0) a prefill
    that long, whose GEMMs take the BLAS / portable path instead of the skinny kernels."""
    eng.reset()
    outs = [eng.prefill(prompt(cfg.vocab_size, 40, seed=1))]
    for i, T in enumerate((1, 2, 3, 5, 9, 17, 33)):
        parents, depths, vis = random_tree(T, seed=20 + i)
        outs.append(eng.forward(prompt(cfg.vocab_size, T, seed=30 + i), eng.cache_len + depths, vis))
        eng.commit(path_to(parents, T - 1))
    if long_prefill:
        eng.reset()
        outs.append(eng.prefill(prompt(cfg.vocab_size, long_prefill, seed=2)))
    return outs


@pytest.mark.parametrize("name", ["ds3_base", "tied_nonorm", "kimi_like", "no_q_lora"])
def test_bf16_weight_modes_give_the_same_logits(name, skinny_isa):
    """A model whose weights are exactly BF16 holds them as BF16 only (the default), as FP32 plus BF16
    copies, or as FP32: the logits are the same bits in all three, for a prefill, tree verifies of
    1..33 tokens after commits and a 1100-token prefill (its GEMMs past the skinny kernels: BLAS on
    blocks of widened rows in 'only'), with each skinny-kernel ISA; and again after each model is
    switched to the other modes (set_bf16_weights / use_bf16_weights). Memory: 'only' holds no FP32
    weight matrix, 'copies' both (no copy of an untied embedding, which is only looked up)."""
    cfg = config_from_dict(config_dict(name))
    w = _bf16_exact(random_weights(cfg, 3))
    engs = {mode: kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=1200, cpu_options={"bf16_weights": mode})
            for mode in MODES}
    n, untied_embed = _weight_elements(cfg, cfg.tie_word_embeddings)
    only, copies, off = (engs[m].model for m in MODES)
    assert [e.model.bf16_weights for e in engs.values()] == list(MODES)
    assert (only.bf16_weight_bytes, only.fp32_weight_bytes) == (2 * n, 0)
    assert (copies.bf16_weight_bytes, copies.fp32_weight_bytes) == (2 * (n - untied_embed), 4 * n)
    assert (off.bf16_weight_bytes, off.fp32_weight_bytes) == (0, 4 * n)
    assert only.memory_bytes < off.memory_bytes < copies.memory_bytes
    assert off.memory_bytes - only.memory_bytes == 2 * n
    ref = _run_model(engs["off"], cfg, long_prefill=1100)
    for mode in MODES:
        for to in (None,) + MODES:
            if to is not None:
                engs[mode].model.set_bf16_weights(to)
                assert engs[mode].model.bf16_weights == to
            got = _run_model(engs[mode], cfg, long_prefill=1100 if to in (None, "only") else 0)
            for x, y in zip(ref, got):
                assert np.isfinite(y).all()
                np.testing.assert_array_equal(x, y, err_msg=f"built {mode}, now {to}")
    only.use_bf16_weights(False)
    assert only.bf16_weights == "off" and only.bf16_weight_bytes == 0
    only.use_bf16_weights(True)
    assert only.bf16_weights == "only"
    copies.use_bf16_weights(False)
    copies.use_bf16_weights(True)
    assert copies.bf16_weights == "copies"
    off.use_bf16_weights(True)
    assert off.bf16_weights == "only"


def test_bf16_only_on_the_portable_sgemm():
    """With the portable SGEMM forced (no skinny kernels), every GEMM of a BF16-only model widens its
    weight rows in blocks: the logits are the bits of the FP32 model on the same path."""
    cfg = config_from_dict(config_dict("ds3_base"))
    w = _bf16_exact(random_weights(cfg, 3))
    only = kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=256)
    off = kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=256, cpu_options={"bf16_weights": "off"})
    _native.sgemm_force_portable(True)
    try:
        a, b = _run_model(only, cfg, long_prefill=200), _run_model(off, cfg, long_prefill=200)
    finally:
        _native.sgemm_force_portable(False)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_fp32_weights_are_held_as_fp32():
    """Weights that are not all BF16 values (an FP32 checkpoint) are held as FP32 in every mode:
    nothing rounds."""
    cfg = config_from_dict(config_dict("ds3_base"))
    w = random_weights(cfg, 0)
    n, _ = _weight_elements(cfg, False)
    for mode in MODES:
        m = kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=32, cpu_options={"bf16_weights": mode}).model
        assert (m.bf16_weight_bytes, m.fp32_weight_bytes) == (0, 4 * n)


def test_a_matrix_with_one_non_bf16_value_is_held_as_fp32():
    """A stacked matrix (the routed experts of a layer) whose later expert holds one value that is not
    a BF16 arrives BF16 first and is widened to FP32 when that value comes; one whose first piece is
    not BF16 stays FP32. Every other matrix stays BF16, and the logits equal the FP32 model's."""
    cfg = config_from_dict(config_dict("ds3_base"))
    w = _bf16_exact(random_weights(cfg, 3))
    layer = cfg.first_k_dense_replace
    last = f"model.layers.{layer}.mlp.experts.{cfg.n_routed_experts - 1}.down_proj.weight"
    first = f"model.layers.{layer}.mlp.experts.0.gate_proj.weight"
    for name in (last, first):
        odd = dict(w)
        odd[name] = np.array(w[name], dtype=np.float32)
        odd[name].flat[7] = np.nextafter(odd[name].flat[7], np.float32(1))  # one value off the BF16 grid
        only = kn.Engine.from_weights(cfg, odd, device="cpu", max_seq_len=256)
        off = kn.Engine.from_weights(cfg, odd, device="cpu", max_seq_len=256, cpu_options={"bf16_weights": "off"})
        stack = (cfg.n_routed_experts * cfg.hidden_size * cfg.moe_intermediate_size
                 * (1 if name == last else 2))  # experts_down [E, Dm, Ie] or experts_gate_up [E, 2Ie, Dm]
        assert only.model.fp32_weight_bytes == 4 * stack, name
        n, _ = _weight_elements(cfg, False)
        assert only.model.bf16_weight_bytes == 2 * (n - stack), name
        for x, y in zip(_run_model(only, cfg, long_prefill=200), _run_model(off, cfg, long_prefill=200)):
            np.testing.assert_array_equal(x, y)


def test_embedded_default_model_holds_bf16():
    """The shipped default is a BF16 checkpoint (its routers F32, as HF saves them): by default every
    BF16 weight matrix is held as BF16 only, the F32 routers as FP32 (the checkpoint's own bytes, a
    third of the memory of FP32 plus copies)."""
    from kdtree_native.checkpoint import SafetensorsFile

    st = SafetensorsFile(os.path.join(kn.default_model_dir(), "model.safetensors"))
    f32 = sum(int(np.prod(st.shape(k))) for k in st.names()
              if st.dtype(k) == "F32" and len(st.shape(k)) == 2)
    assert f32 > 0
    eng = kn.Engine.from_pretrained(kn.default_model_dir(), device="cpu")
    assert eng.model.bf16_weights == "only"
    assert eng.model.bf16_weight_bytes > 0 and eng.model.fp32_weight_bytes == 4 * f32


@pytest.mark.parametrize("mode", MODES)
def test_bf16_weights_follow_set_weight(mode):
    """Replacing a weight after finalize: with BF16 values it is held as the mode says, with values off
    the BF16 grid as FP32 (then every GEMM on it reads FP32); either way the logits equal those of a
    model built with the new weight."""
    cfg = config_from_dict(config_dict("ds3_base"))
    w = _bf16_exact(random_weights(cfg, 3))
    name = "model.layers.1.self_attn.o_proj.weight"
    size = int(np.prod(w[name].shape))
    for new, exact in ((_bf16_exact(random_weights(cfg, 4))[name], True), (random_weights(cfg, 4)[name], False)):
        eng = kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=64, cpu_options={"bf16_weights": mode})
        before = (eng.model.bf16_weight_bytes, eng.model.fp32_weight_bytes)
        eng.model.set_weight(name, new.astype(np.float32))
        eng.model.finalize()
        if exact or mode == "off":
            assert (eng.model.bf16_weight_bytes, eng.model.fp32_weight_bytes) == before
        else:
            grew = 0 if mode == "copies" else 4 * size
            assert eng.model.bf16_weight_bytes == before[0] - 2 * size
            assert eng.model.fp32_weight_bytes == before[1] + grew
        ref = kn.Engine.from_weights(cfg, {**w, name: new}, device="cpu", max_seq_len=64,
                                     cpu_options={"bf16_weights": "off"})
        ids = prompt(cfg.vocab_size, 12, seed=5)
        for T in (12, 1, 4):
            toks = ids[:T]
            pos = np.arange(T)
            np.testing.assert_array_equal(eng.forward(toks, pos), ref.forward(toks, pos))


@pytest.mark.parametrize("mode", MODES)
def test_set_weight_bf16_equals_set_weight(mode):
    """set_weight_bf16(name, bits) (what from_pretrained hands a CPU model for a BF16 tensor) holds what
    set_weight of the widened values holds, in each mode: the same bytes, the same logits bit for bit;
    with one matrix's values off the BF16 grid given as float32 beside the others' bits, too."""
    from hf_models import to_bf16_bits

    cfg = config_from_dict(config_dict("kimi_like"))
    w = _bf16_exact(random_weights(cfg, 3))
    odd = "model.layers.1.self_attn.o_proj.weight"
    w[odd] = random_weights(cfg, 5)[odd]  # not BF16: set as float32 in both
    a = _native.CpuModel(cfg.to_native(), 128, bf16_weights=mode)
    b = _native.CpuModel(cfg.to_native(), 128, bf16_weights=mode)
    for name, arr in w.items():
        f = np.ascontiguousarray(arr, dtype=np.float32)
        a.set_weight(name, f)
        if name == odd:
            b.set_weight(name, f)
        else:
            b.set_weight_bf16(name, to_bf16_bits(f))
    a.finalize()
    b.finalize()
    assert (a.bf16_weight_bytes, a.fp32_weight_bytes, a.memory_bytes) == \
        (b.bf16_weight_bytes, b.fp32_weight_bytes, b.memory_bytes)
    ids = prompt(cfg.vocab_size, 20, seed=2)
    np.testing.assert_array_equal(a.forward(ids, np.arange(20)), b.forward(ids, np.arange(20)))


def test_set_weight_bf16_validation():
    """set_weight_bf16 takes uint16 bits of the config's shape; a NaN or infinity among them is refused
    as set_weight refuses it (the tensor and the first bad index named), unless check_finite=False."""
    cfg = config_from_dict(config_dict("ds3_base"))
    m = _native.CpuModel(cfg.to_native(), 16)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    shape = expected_weight_shapes(cfg)[name]
    with pytest.raises(ValueError, match="uint16"):
        m.set_weight_bf16(name, np.zeros(shape, np.float32))
    with pytest.raises(ValueError, match=r"has shape"):
        m.set_weight_bf16(name, np.zeros((shape[0], shape[1] + 1), np.uint16))
    for pos, bits, what in ((0, 0x7FC0, "NaN"), (5, 0xFF80, "an infinity"), (9, 0xFFC1, "NaN")):
        a = np.full(shape, 0x3F80, np.uint16)  # 1.0
        a.flat[pos] = bits
        a.flat[-1] = 0x7F80  # a later one: the first is named
        with pytest.raises(ValueError, match=rf"'{name}' holds {what} at flat index {pos} "):
            m.set_weight_bf16(name, a)
    m.set_weight_bf16(name, a, check_finite=False)


def test_bf16_weights_option_is_checked():
    """bf16_weights must be one of the three names; the older bf16_weight_copies maps onto it and may
    not contradict it."""
    cfg = config_from_dict(config_dict("ds3_base"))
    native = cfg.to_native()
    with pytest.raises(ValueError, match="bf16_weights must be 'only', 'copies' or 'off', got 'half'"):
        _native.CpuModel(native, 16, bf16_weights="half")
    with pytest.raises(ValueError, match="contradicts"):
        _native.CpuModel(native, 16, bf16_weights="copies", bf16_weight_copies=False)
    assert _native.CpuModel(native, 16, bf16_weight_copies=False).bf16_weights == "off"
    assert _native.CpuModel(native, 16, bf16_weight_copies=True).bf16_weights == "copies"
    assert _native.CpuModel(native, 16).bf16_weights == "only"
    m = _native.CpuModel(native, 16)
    with pytest.raises(ValueError, match="bf16_weights must be"):
        m.set_bf16_weights("bf16")


def test_read_cache_range_is_checked_before_allocating():
    """read_cache(layer, begin, n) with n or begin past the cache: a ValueError (it used to make
    the [n, C + R] output first: MemoryError for n = 2**40)."""
    cfg = config_from_dict(config_dict("ds3_base"))
    eng = kn.Engine.from_weights(cfg, random_weights(cfg, 0), max_seq_len=16)
    eng.prefill([1, 2, 3])
    for begin, n in ((0, 2**40), (2**62, 1), (-1, 1), (10, 7)):
        with pytest.raises(ValueError, match="outside the cache of 16 rows"):
            eng.model.read_cache(0, begin, n)
    assert eng.model.read_cache(0, 0, 3).shape == (3, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def test_blas_calls_shared_over_the_pool_give_the_same_bits(tmp_path):
    """With OpenBLAS, large prefill GEMMs run single-threaded and are shared out over the pool by column
    ranges (sgemm.cpp), whatever OPENBLAS_NUM_THREADS says (OpenBLAS threading itself gave other bits on an
    Intel Xeon: the fifty-fifth session's CI machine). The logits of a 300-token prefill (dense MLP and
    lm_head through BLAS) must be the same bits with the variable unset, 1 and 2, and with one pool thread."""
    import os
    import subprocess
    import sys

    if "openblas" not in kn.build_info()["cpu_blas"].lower():
        pytest.skip("the module is not linked with OpenBLAS")
    code = ("import sys, numpy as np, kdtree_native as kn\n"
            "eng = kn.Engine.from_pretrained(kn.default_model_dir(), device='cpu', max_seq_len=512)\n"
            "ids = np.random.default_rng(0).integers(5, 4000, 300)\n"
            "np.save(sys.argv[1], eng.prefill(ids))\n")
    outs = []
    for i, env in enumerate(({}, {"OPENBLAS_NUM_THREADS": "1"}, {"OPENBLAS_NUM_THREADS": "2"},
                             {"KDTREE_NUM_THREADS": "1"})):
        path = tmp_path / f"l{i}.npy"
        e = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
        e.update(env)
        subprocess.run([sys.executable, "-c", code, str(path)], check=True, env=e, timeout=300)
        outs.append(np.load(path))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
