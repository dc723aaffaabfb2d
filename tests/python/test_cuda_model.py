"""The GPU target model (cuda/model/, _native.CudaModel) against the CPU backend and HF.

On a CUDA device (marker cuda; skipped without one):
* CUDA vs CPU logits within 1e-4 of the logits' scale on every PARITY_CONFIG: prefill, decode,
  tree verify, commit (the latent cache itself too), greedy decode token for token;
* both expert kernels (GEMV-style and tiled) and both attention kernels of verify_attention (the
  fast C=512/R=64 one, with key splits, and the simple one), on a config with C=512, R=64;
* tree consistency on the GPU: every node's verify logits == decoding its path;
* chunked causal prefill (max_tokens smaller than the prompt), general commit lists;
* the device-pointer path (forward_ptr / commit_ptr with torch CUDA tensors) == the host path;
* out-of-memory at construction is a RuntimeError with the sizes; input validation;
* HF parity on the GPU (marker hf too): prefill logits and 24 greedy tokens.
Everywhere (no device needed): the module imports, cuBLAS is probed at run time, constructing
the model without a device is a clear RuntimeError and a bad config a ValueError.
"""
import numpy as np
import pytest

import kdtree_native as kn
from kdtree_native import _native
from kdtree_native.checkpoint import load_weights
from kdtree_native.config import config_from_dict, load_config

from hf_models import PARITY_CONFIGS, cached_checkpoint, config_dict, hf_greedy, hf_logits, random_weights
from tree_cases import path_to, random_tree

NAMES = list(PARITY_CONFIGS)
HAS_MODEL = hasattr(_native, "CudaModel")
DEVICE_OK = HAS_MODEL and bool(_native.cuda_available()[0])
needs_device = pytest.mark.skipif(not DEVICE_OK, reason="no CUDA device (or the GPU model is not built)")

# C = 512, R = 64: the shapes of verify_attention's fast kernel (DeepSeek-V3 / K2 latent sizes).
MLA512 = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, num_attention_heads=4,
              num_key_value_heads=4, hidden_size=64, q_lora_rank=48, vocab_size=300, max_position_embeddings=2048)

# Sizes that are not multiples of 4 or 32: the scalar (non-float4) paths of the expert kernels,
# partial warps in the row kernels.
ODD = dict(hidden_size=42, moe_intermediate_size=21, intermediate_size=37, q_lora_rank=20, kv_lora_rank=18,
           qk_nope_head_dim=6, qk_rope_head_dim=6, v_head_dim=7, vocab_size=157, n_routed_experts=6, n_group=3,
           topk_group=2, num_experts_per_tok=3)
EXTRA = {"odd_sizes": ODD, "mla512": MLA512}


def spec(name):
    """A PARITY_CONFIGS name, or one of EXTRA (overrides of the base config)."""
    return EXTRA.get(name, name)


TOL = 1e-4


def rel_to_scale(a, b):
    """max |a - b| relative to the logits' scale (max |b|); NaN anywhere fails."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert a.shape == b.shape
    assert np.isfinite(a).all() and np.isfinite(b).all()
    return float(np.abs(a - b).max() / np.abs(b).max())


def prompt(vocab, n, seed):
    return np.random.default_rng(seed).integers(0, vocab, n)


def vis_bits(vis):
    """bool [T, T] -> uint64 [T, ceil(T/64)]: bit j % 64 of word j // 64 of row i = vis[i, j]."""
    T = vis.shape[0]
    W = (T + 63) // 64
    padded = np.zeros((T, W * 64), dtype=bool)
    padded[:, :T] = vis
    return np.packbits(padded, axis=1, bitorder="little").view("<u8").reshape(T, W)


def load(model, weights, check_finite=True):
    for name, arr in weights.items():
        model.set_weight(name, np.ascontiguousarray(arr, dtype=np.float32), check_finite)
    model.finalize()
    return model


_PAIRS = {}


def pair(name_or_overrides, seed=0, max_seq_len=256, **opts):
    """(cpu model, cuda model, cfg) on the same random float32 weights, caches reset."""
    key = (repr(name_or_overrides), seed, max_seq_len, tuple(sorted(opts.items())))
    if key not in _PAIRS:
        cfg = config_from_dict(config_dict(name_or_overrides))
        w = {k: v.astype(np.float32) for k, v in random_weights(cfg, seed).items()}
        cpu = load(_native.CpuModel(cfg.to_native(), max_seq_len), w)
        gpu = load(_native.CudaModel(cfg.to_native(), max_seq_len, **opts), w)
        _PAIRS[key] = (cpu, gpu, cfg)
    cpu, gpu, cfg = _PAIRS[key]
    cpu.reset()
    gpu.reset()
    return cpu, gpu, cfg


def both(cpu, gpu, tokens, positions, vis=None):
    return cpu.forward(tokens, positions, vis), gpu.forward(tokens, positions, vis)


def prefill(m, ids):
    m.reset()
    lg = m.forward(ids, np.arange(len(ids)), None)
    m.commit(np.arange(len(ids)))
    return lg


def decode(m, tok):
    lg = m.forward([tok], [m.cache_len], None)
    m.commit([0])
    return lg[0]


def assert_same_cache(cpu, gpu, cfg, n=None):
    n = cpu.cache_len if n is None else n
    assert gpu.cache_len == cpu.cache_len
    for layer in range(cfg.num_hidden_layers):
        a, b = gpu.read_cache(layer, 0, n), cpu.read_cache(layer, 0, n)
        assert np.isfinite(a).all()
        assert np.abs(a - b).max() <= TOL * max(1.0, np.abs(b).max()), f"layer {layer}"


# ---- everywhere: import, cuBLAS probe, errors without a device -----------------------------

def test_module_imports_and_probes_cublas():
    ok, info = _native.cublas_probe()
    assert isinstance(ok, bool) and isinstance(info, str) and info
    built = kn.build_info()
    assert HAS_MODEL == bool(built["cuda"] and built["cublas"])
    if ok:
        assert "libcublas" in info
    else:
        assert "libcublas" in info or "built without" in info   # the paths tried, or why


@pytest.mark.skipif(not HAS_MODEL, reason="GPU model not built")
def test_bad_config_is_value_error_before_any_device_work():
    cfg = config_from_dict(config_dict("ds3_base")).to_native()
    bad = dict(cfg)
    del bad["softmax_scale"]
    with pytest.raises(ValueError, match="softmax_scale"):
        _native.CudaModel(bad, 16)
    bad = dict(cfg, rope_inv_freq=cfg["rope_inv_freq"][:-1])
    with pytest.raises(ValueError, match="rope_inv_freq"):
        _native.CudaModel(bad, 16)
    with pytest.raises(ValueError, match="max_seq_len"):
        _native.CudaModel(cfg, 0)
    with pytest.raises(ValueError, match="math"):
        _native.CudaModel(cfg, 16, math="fast")
    with pytest.raises(ValueError, match="expert_kernel"):
        _native.CudaModel(cfg, 16, expert_kernel="magic")
    with pytest.raises(ValueError, match="attention_kernel"):
        _native.CudaModel(cfg, 16, attention_kernel="flash")
    for smt in (-2, 65):
        with pytest.raises(ValueError, match="skinny_max_tokens"):
            _native.CudaModel(cfg, 16, skinny_max_tokens=smt)
    for smt in (-2, 65):
        with pytest.raises(ValueError, match="skinny_big_max_tokens"):
            _native.CudaModel(cfg, 16, skinny_big_max_tokens=smt)
    with pytest.raises(ValueError, match="tile_max_tokens"):
        _native.CudaModel(cfg, 16, tile_max_tokens=-2)
    with pytest.raises(ValueError, match="q_fold_max_tokens"):
        _native.CudaModel(cfg, 16, q_fold_max_tokens=-2)


@pytest.mark.skipif(not HAS_MODEL or DEVICE_OK, reason="needs a build with the GPU model and no usable device")
def test_no_device_is_a_clear_runtime_error():
    cfg = config_from_dict(config_dict("ds3_base")).to_native()
    with pytest.raises(RuntimeError, match="CUDA device|cuBLAS"):
        _native.CudaModel(cfg, 16)


# ---- CUDA vs CPU ----------------------------------------------------------------------------

@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("name", NAMES + list(EXTRA))
def test_prefill_decode_match_cpu(name):
    cpu, gpu, cfg = pair(spec(name))
    assert gpu.device == "cuda" and "libcublas" in gpu.cublas_library
    ids = prompt(cfg.vocab_size, 23, seed=1)
    a, b = prefill(cpu, ids), prefill(gpu, ids)
    assert b.dtype == np.float32 and b.shape == (23, cfg.vocab_size)
    assert rel_to_scale(b, a) < TOL
    for k, tok in enumerate(prompt(cfg.vocab_size, 5, seed=2)):
        assert rel_to_scale(decode(gpu, int(tok)), decode(cpu, int(tok))) < TOL, f"decode step {k}"
    assert_same_cache(cpu, gpu, cfg)


@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("T", [5, 40, 300])
def test_forward_last_on_cuda(T):
    """CudaModel.forward_last(tokens, positions, rows): the last `rows` rows of forward()'s logits (the LM
    head over those rows alone when they lie in the last max_tokens chunk; within float rounding of
    forward's, whose LM head ran on another row count), the same cache bits: a decode after it equals the
    decode after forward(); CPU's forward_last agrees; rows outside [0, T] is a ValueError."""
    cpu, gpu, cfg = pair("ds3_base", max_seq_len=400, max_tokens=64)
    ids = prompt(cfg.vocab_size, T, seed=7)
    pos = np.arange(T)
    full = prefill(gpu, ids)
    after = decode(gpu, 3)
    for rows in (0, 1, 3):
        gpu.reset()
        got = gpu.forward_last(ids, pos, rows)
        assert got.shape == (rows, cfg.vocab_size)
        if rows:
            assert rel_to_scale(got, full[T - rows:]) < 1e-5
            cpu.reset()
            assert rel_to_scale(got, cpu.forward_last(ids, pos, rows)) < TOL
        gpu.commit(np.arange(T))
        np.testing.assert_array_equal(decode(gpu, 3), after)
    gpu.reset()  # (a full cache would be refused first)
    with pytest.raises(ValueError, match="rows"):
        gpu.forward_last(ids, pos, T + 1)


@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("name", NAMES + list(EXTRA))
def test_tree_verify_and_commit_match_cpu(name):
    cpu, gpu, cfg = pair(spec(name))
    ids = prompt(cfg.vocab_size, 11, seed=3)
    prefill(cpu, ids)
    prefill(gpu, ids)
    parents, depths, vis = random_tree(17, seed=4 + len(name))
    toks = prompt(cfg.vocab_size, 17, seed=5)
    a, b = both(cpu, gpu, toks, 11 + depths, vis)
    assert rel_to_scale(b, a) < TOL
    keep = path_to(parents, int(np.argmax(depths)))
    cpu.commit(keep)
    gpu.commit(keep)
    assert gpu.cache_len == 11 + len(keep) and gpu.pending_len == 0
    assert_same_cache(cpu, gpu, cfg)
    tok = int(toks[0])
    assert rel_to_scale(decode(gpu, tok), decode(cpu, tok)) < TOL


@pytest.mark.cuda
@needs_device
def test_truncate_matches_cpu():
    """truncate(n) rolls the GPU cache back like the CPU one: decoding on from n gives the same
    logits and cache rows; bad lengths are ValueErrors that leave the cache alone."""
    cpu, gpu, cfg = pair(spec("ds3_base"))
    ids = prompt(cfg.vocab_size, 15, seed=21)
    prefill(cpu, ids)
    prefill(gpu, ids)
    other = prompt(cfg.vocab_size, 3, seed=22)
    both(cpu, gpu, other, 15 + np.arange(3))  # pending, dropped by truncate
    for m in (cpu, gpu):
        m.truncate(9)
        assert m.cache_len == 9 and m.pending_len == 0
    a, b = both(cpu, gpu, other, 9 + np.arange(3))
    assert rel_to_scale(b, a) < TOL
    cpu.commit(np.arange(3))
    gpu.commit(np.arange(3))
    assert_same_cache(cpu, gpu, cfg)
    for bad in (-1, 13):
        with pytest.raises(ValueError, match="truncate"):
            gpu.truncate(bad)
    assert gpu.cache_len == 12
    tok = int(ids[0])
    assert rel_to_scale(decode(gpu, tok), decode(cpu, tok)) < TOL


@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("name", NAMES)
def test_greedy_identical_to_cpu(name):
    cpu, gpu, cfg = pair(name)
    ids = prompt(cfg.vocab_size, 9, seed=100 + len(name))
    out = []
    for m in (cpu, gpu):
        nxt = int(np.argmax(prefill(m, ids)[-1]))
        toks = []
        for _ in range(24):
            toks.append(nxt)
            nxt = int(np.argmax(decode(m, nxt)))
        out.append(toks)
    assert out[1] == out[0]


@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("name", ["ds3_base", "neox_yarn_groups", "no_q_lora"])
def test_tree_nodes_equal_sequential_decode_on_gpu(name):
    _, gpu, cfg = pair(name)
    ids = prompt(cfg.vocab_size, 10, seed=6)
    n = 21
    parents, depths, vis = random_tree(n, seed=7)
    toks = prompt(cfg.vocab_size, n, seed=8)
    prefill(gpu, ids)
    tree = gpu.forward(toks, 10 + depths, vis)
    for i in range(n):
        prefill(gpu, ids)
        for t in toks[path_to(parents, i)]:
            last = decode(gpu, int(t))
        assert rel_to_scale(tree[i], last) < TOL, f"node {i}"


@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("expert_kernel,mma_rows", [("skinny", 0), ("tiled", 0), ("mma", 8), ("mma", 16), ("mma", 32),
                                                     ("mma", 64), ("auto", 0)])
@pytest.mark.parametrize("name", ["ds3_base", "neox_many_groups", "kimi_like", "odd_sizes"])
def test_expert_kernels_match_cpu(name, expert_kernel, mma_rows):
    """Every grouped expert GEMM (the tensor-core one at every tile height; it falls back to the
    GEMV-style kernel on odd_sizes), with several tiles per expert (T*K >> E)."""
    cpu, gpu, cfg = pair(spec(name), max_seq_len=400, expert_kernel=expert_kernel, expert_mma_rows=mma_rows)
    for T, seed in ((1, 20), (37, 21), (300, 22)):
        cpu.reset()
        gpu.reset()
        ids = prompt(cfg.vocab_size, T, seed=seed)
        a, b = both(cpu, gpu, ids, np.arange(T))
        assert rel_to_scale(b, a) < TOL, f"T={T}"
    counts = gpu.last_expert_counts()
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert counts.shape == (n_moe, cfg.n_routed_experts)
    assert (counts.sum(axis=1) == 300 * cfg.num_experts_per_tok).all()


@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("name", ["ds3_base", "kimi_like", "mla512"])
def test_folded_query_projection_matches_cpu(name):
    """q_fold_max_tokens: steps of up to that many tokens project the queries through the folded matrix and
    scale the attention scores by q_a's RMS factor. Against the CPU model (prefill past the fold's reach, then
    decode and tree steps inside it; mla512 runs the tensor-core / split-KV attention kernels with the factors),
    and against the same GPU model without the fold: close, and not the same bits (the folded path ran)."""
    cpu, gpu, cfg = pair(spec(name), max_seq_len=400, q_fold_max_tokens=40)
    _, plain, _ = pair(spec(name), max_seq_len=400, q_fold_max_tokens=0)
    ids = prompt(cfg.vocab_size, 60, seed=41)  # 60 tokens: the prefill itself is past the fold (40)
    for m in (cpu, gpu, plain):
        prefill(m, ids)
    assert rel_to_scale(gpu.forward(ids[:5], 60 + np.arange(5), None), cpu.forward(ids[:5], 60 + np.arange(5), None)) < TOL
    differs = False
    for T, seed in ((1, 42), (17, 43), (40, 44)):
        parents, depths, vis = random_tree(T, seed=seed)
        toks = prompt(cfg.vocab_size, T, seed=seed + 10)
        pos = 60 + depths
        a, b, c = cpu.forward(toks, pos, vis), gpu.forward(toks, pos, vis), plain.forward(toks, pos, vis)
        assert rel_to_scale(b, a) < TOL, f"T={T}"
        assert rel_to_scale(c, a) < TOL, f"T={T} (no fold)"
        differs |= not np.array_equal(b, c)
    assert differs, "the folded steps gave the unfolded bits: the fold did not run"
    # decode (commit) inside the fold, then the caches agree
    for t in prompt(cfg.vocab_size, 3, seed=45):
        la, lb = decode(cpu, int(t)), decode(gpu, int(t))
        assert rel_to_scale(lb, la) < TOL
    assert_same_cache(cpu, gpu, cfg)


@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("context_buckets", [1, 4])
@pytest.mark.parametrize("name", ["mla512", "kimi_like"])
def test_eager_graph_and_host_steps_are_bit_identical(name, context_buckets):
    """A step gives the same bits whether it runs eagerly (the first forward_ptr of a shape), is
    captured and replayed (the second and third), or goes through the host path forward(): every
    step sizes the attention for its context bucket and reads the committed length from the
    device (before, an eager step split the keys for the exact length and a graph for the bucket,
    a different summation order). Contexts chosen so that the exact and bucket split counts
    differ (mla512 runs the split-KV kernel); trees and a causal 17-token step."""
    try:
        import torch
    except ImportError:
        pytest.skip("torch needed for device buffers")
    cfg = config_from_dict(config_dict(spec(name)))
    w = {k: v.astype(np.float32) for k, v in random_weights(cfg, 0).items()}
    m = load(_native.CudaModel(cfg.to_native(), 700, context_buckets=context_buckets), w)
    V = cfg.vocab_size
    dev = torch.device("cuda")
    for L, T in ((37, 1), (300, 1), (300, 5), (600, 17)):
        prefill(m, prompt(V, L, seed=L))
        toks = prompt(V, T, seed=L + T).astype(np.int32)
        pos = (L + np.arange(T)).astype(np.int32)
        t_tok, t_pos = torch.as_tensor(toks, device=dev), torch.as_tensor(pos, device=dev)
        t_out = torch.empty((T, V), device=dev)
        outs = []
        for rep in range(3):  # eager, then captured + replayed, then replayed
            m.forward_ptr(t_tok.data_ptr(), t_pos.data_ptr(), 0, 0, T, t_out.data_ptr())
            torch.cuda.synchronize()
            outs.append(t_out.cpu().numpy().copy())
        host = m.forward(toks, pos, None)
        assert np.isfinite(host).all()
        for rep in (1, 2):
            assert np.array_equal(outs[0], outs[rep]), f"L={L} T={T} eager vs graph (call {rep + 1})"
        assert np.array_equal(outs[0], host), f"L={L} T={T} device vs host path"


def _bucket_plain(L, T, n, max_seq_len):
    """The context bucket by enumeration: every bucket top (256, then n equal steps per doubling
    past it), the first that holds L + 1 keys, capped so T more rows fit."""
    tops, lo = [256], 256
    while lo < 1 << 22:
        tops += [lo + j * lo // n for j in range(1, n + 1)]
        lo *= 2
    return min(min(t for t in tops if t >= L + 1), max_seq_len - T)


@pytest.mark.cuda
@needs_device
def test_context_buckets_rule_and_logits():
    """context_buckets = n splits each doubling of the context past 256 into n buckets: the bucket
    equals its plain enumeration at the doublings' edges and between them; the option outside 1 / 2
    / 4 / 8 is refused; and the logits of steps whose attention is sized for the finer bucket (other
    key splits) match the CPU model as the default's do."""
    cfg = config_from_dict(config_dict(spec("mla512")))
    w = {k: v.astype(np.float32) for k, v in random_weights(cfg, 0).items()}
    msl = 1700
    cpu = load(_native.CpuModel(cfg.to_native(), msl), w)
    models = {n: load(_native.CudaModel(cfg.to_native(), msl, context_buckets=n), w) for n in (1, 2, 4, 8)}
    for n, m in models.items():
        for L in (0, 1, 254, 255, 256, 257, 300, 319, 320, 511, 512, 513, 700, 1023, 1024, 1100, 1600, 1690):
            for T in (1, 9, 65):
                if L + T <= msl:
                    assert m.context_bucket(L, T) == _bucket_plain(L, T, n, msl), f"n={n} L={L} T={T}"
    for bad in (0, 3, 16, -1):
        with pytest.raises(ValueError, match="context_buckets"):
            _native.CudaModel(cfg.to_native(), 64, context_buckets=bad)
    for L, T in ((-1, 1), (0, 0), (msl, 1), (msl - 8, 9)):
        with pytest.raises(ValueError, match="context_bucket"):
            models[1].context_bucket(L, T)
    V = cfg.vocab_size
    for L, T in ((300, 1), (700, 1), (1500, 1), (700, 17)):
        ids = prompt(V, L, seed=L)
        toks = prompt(V, T, seed=L + 1)
        pos = L + np.arange(T)
        prefill(cpu, ids)
        ref = cpu.forward(toks, pos, None)
        for n in (1, 4):
            prefill(models[n], ids)
            got = models[n].forward(toks, pos, None)
            assert rel_to_scale(got, ref) < TOL, f"n={n} L={L} T={T}"


@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("name", ["ds3_base", "kimi_like", "no_q_lora", "tied_nonorm", "mla512"])
def test_side_stream_equals_one_stream(name):
    """side_stream=True (the default: mla_prep beside the W_UK product, the shared expert beside
    the routed ones; graph branches when captured): the same kernels on the same data, so the
    logits equal the one-stream model's bit for bit, step after step (decode, small trees, a
    17-token step, a 65-token one: the shared expert's SwiGLU and product on the side stream through
    linear_tile), eager (forward) and, with torch, graph-replayed (forward_ptr from the second call of
    a shape), and the caches the same. Both models are built here (fresh graph caches)."""
    cfg = config_from_dict(config_dict(spec(name)))
    w = {k: v.astype(np.float32) for k, v in random_weights(cfg, 0).items()}
    one = load(_native.CudaModel(cfg.to_native(), 200, side_stream=False), w)
    two = load(_native.CudaModel(cfg.to_native(), 200), w)
    V = cfg.vocab_size
    for m in (one, two):
        prefill(m, prompt(V, 30, seed=51))
    for T in (1, 2, 4, 17, 65):
        toks = prompt(V, T, seed=60 + T)
        pos = one.cache_len + np.arange(T)
        vis = np.tril(np.ones((T, T), dtype=bool))
        if T >= 3:
            vis[T - 1, 1: T - 1] = False  # a sibling branch: a tree, not a chain
        a, b = one.forward(toks, pos, vis), two.forward(toks, pos, vis)
        assert np.isfinite(a).all()
        assert np.array_equal(a, b), f"eager T={T}"
        for m in (one, two):
            m.commit([0])
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        dev = torch.device("cuda")
        for T in (1, 4, 17, 65):
            bufs = {}
            for m in (one, two):  # fixed buffers per model and shape: one graph key each
                bufs[id(m)] = (torch.empty(T, dtype=torch.int32, device=dev), torch.empty(T, dtype=torch.int32, device=dev),
                               torch.empty((T, V), device=dev))
            for rep in range(3):  # the second and third calls replay the captured graph
                toks = prompt(V, T, seed=80 + 3 * T + rep)
                outs = []
                for m in (one, two):
                    t_tok, t_pos, t_out = bufs[id(m)]
                    t_tok.copy_(torch.as_tensor(toks.astype(np.int32)))
                    t_pos.copy_(torch.as_tensor((m.cache_len + np.arange(T)).astype(np.int32)))
                    torch.cuda.synchronize()
                    m.forward_ptr(t_tok.data_ptr(), t_pos.data_ptr(), 0, 0, T, t_out.data_ptr())
                    torch.cuda.synchronize()
                    outs.append(t_out.cpu().numpy().copy())
                    m.commit([0])
                assert np.array_equal(outs[0], outs[1]), f"graph T={T} rep={rep}"
        assert two.graph_replays >= 3
    n = one.cache_len
    assert two.cache_len == n
    for layer in range(cfg.num_hidden_layers):
        assert np.array_equal(one.read_cache(layer, 0, n), two.read_cache(layer, 0, n)), f"layer {layer}"


@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("name", ["ds3_base", "kimi_like", "no_q_lora", "odd_sizes", "mla512"])
def test_skinny_linear_and_cublas_match_cpu(name):
    """Steps of 1..64 tokens (and 65..300 for the tiled kernel): the dense projections routed
    automatically (skinny for 1-5 tokens and, at 17-20, for matrices under 2 MB and the W_UK / W_UV
    heads: all of these small configs; linear_tile for 6-72 otherwise and up to 264 for matrices of
    <= 32 MB: all of these; cuBLAS beyond), through linear_skinny only (skinny_max_tokens=64: up to 64, in token slices),
    through linear_tile only (skinny_max_tokens=0, tile_max_tokens=400: several token tiles
    beyond 64) and through cuBLAS only (both 0), all against the CPU model. odd_sizes has rows
    that are not multiples of 4: linear_tile passes them to cuBLAS."""
    cpu, gpu, cfg = pair(spec(name), max_seq_len=400)
    variants = {"auto": gpu,
                "cuBLAS": pair(spec(name), max_seq_len=400, skinny_max_tokens=0, tile_max_tokens=0)[1],
                "skinny slices": pair(spec(name), max_seq_len=400, skinny_max_tokens=64)[1],
                "tiled": pair(spec(name), max_seq_len=400, skinny_max_tokens=0, tile_max_tokens=400)[1]}
    ids = prompt(cfg.vocab_size, 20, seed=5)
    for m in [cpu] + list(variants.values()):
        prefill(m, ids)
    for T in (1, 2, 5, 8, 17, 24, 25, 32, 33, 49, 64, 65, 72, 73, 129, 264, 265, 300):
        toks = prompt(cfg.vocab_size, T, seed=T)
        pos = 20 + np.arange(T)
        a = cpu.forward(toks, pos, None)
        for label, m in variants.items():
            assert rel_to_scale(m.forward(toks, pos, None), a) < TOL, f"{label} T={T}"
    with pytest.raises(ValueError, match="skinny_max_tokens"):
        _native.CudaModel(cfg.to_native(), 64, skinny_max_tokens=65)


@pytest.mark.cuda
@needs_device
def test_weights_bigger_than_the_l2_match_cpu():
    """A weight matrix of more than 48 MiB (here lm_head: vocab 200000 x hidden 64 = 51.2 MB) runs
    through cuBLAS in steps of more than skinny_big_max_tokens tokens and through linear_skinny
    otherwise (always with its RMSNorm fused, <= 4 tokens): every choice matches the CPU model at
    1, 4, 5 and 17 tokens. (auto = -1; 0 and 4 send it to cuBLAS as early as allowed.)"""
    big = dict(MLA512, vocab_size=200000)
    cpu, gpu, cfg = pair(big, max_seq_len=64)
    models = [gpu] + [pair(big, max_seq_len=64, skinny_big_max_tokens=v)[1] for v in (0, 4)]
    ids = prompt(cfg.vocab_size, 10, seed=7)
    for m in [cpu] + models:
        prefill(m, ids)
    for T in (1, 4, 5, 17):
        toks = prompt(cfg.vocab_size, T, seed=30 + T)
        pos = 10 + np.arange(T)
        a = cpu.forward(toks, pos, None)
        for m, label in zip(models, ("auto", "0", "4")):
            assert rel_to_scale(m.forward(toks, pos, None), a) < TOL, f"skinny_big_max_tokens={label} T={T}"


@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("opts", [{}, {"attention_naive": True}, {"attention_kernel": "tiled"},
                                  {"attention_kernel": "splitkv"}, {"attention_kernel": "decode"},
                                  {"attention_kernel": "mma"}])
def test_mla512_fast_and_simple_attention_match_cpu(opts):
    """C=512, R=64: verify_attention's kernels (auto, the simple one, each fast one forced; a
    forced kernel passes shapes it cannot take on); prefill, decode at L=300, a tree of 65
    nodes, commit."""
    cpu, gpu, cfg = pair(MLA512, max_seq_len=512, **opts)
    ids = prompt(cfg.vocab_size, 300, seed=30)
    assert rel_to_scale(prefill(gpu, ids), prefill(cpu, ids)) < TOL
    for tok in prompt(cfg.vocab_size, 3, seed=31):
        assert rel_to_scale(decode(gpu, int(tok)), decode(cpu, int(tok))) < TOL
    parents, depths, vis = random_tree(65, seed=32)
    toks = prompt(cfg.vocab_size, 65, seed=33)
    a, b = both(cpu, gpu, toks, cpu.cache_len + depths, vis)
    assert rel_to_scale(b, a) < TOL
    keep = path_to(parents, int(np.argmax(depths)))
    cpu.commit(keep)
    gpu.commit(keep)
    assert_same_cache(cpu, gpu, cfg)


@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("name", ["kimi_like", "mla512"])
def test_pdl_launches_equal_plain_launches(name):
    """Programmatic dependent launch (the default, cuda/launch.h) against plain stream-ordered
    launches: the same logits and cache bit for bit, eager and (with torch) graph-replayed. A
    kernel that touched its predecessor's output before griddepcontrol.wait would differ."""
    assert _native.cuda_pdl_enabled()
    torch = None
    try:
        import torch as _torch
        torch = _torch if _torch.cuda.is_available() else None
    except ImportError:
        pass
    runs = {}
    for on in (True, False):
        prev = _native.cuda_set_pdl(on)
        try:
            _, gpu, cfg = pair(MLA512 if name == "mla512" else name, max_seq_len=512)
            V = cfg.vocab_size
            out = [prefill(gpu, prompt(V, 300, seed=70))]
            out += [decode(gpu, int(t)) for t in prompt(V, 4, seed=71)]
            parents, depths, vis = random_tree(65, seed=72)
            toks = prompt(V, 65, seed=73)
            out.append(gpu.forward(toks, gpu.cache_len + depths, vis))
            gpu.commit(path_to(parents, int(np.argmax(depths))))
            out += [gpu.read_cache(l, 0, gpu.cache_len) for l in range(cfg.num_hidden_layers)]
            if torch is not None:  # device pointers: the second call of a shape replays its CUDA graph
                dev = torch.device("cuda")
                t_out = torch.empty((1, V), device=dev)  # fixed buffers: one graph key
                t_tok = torch.empty(1, dtype=torch.int32, device=dev)
                t_pos = torch.empty(1, dtype=torch.int32, device=dev)
                for t in prompt(V, 6, seed=74):
                    t_tok.fill_(int(t))
                    t_pos.fill_(gpu.cache_len)
                    torch.cuda.synchronize()
                    gpu.forward_ptr(t_tok.data_ptr(), t_pos.data_ptr(), 0, 0, 1, t_out.data_ptr())
                    torch.cuda.synchronize()
                    out.append(t_out.cpu().numpy().copy())
                    gpu.commit([0])
                assert gpu.graph_replays >= 4
        finally:
            _native.cuda_set_pdl(prev)
        runs[on] = out
    assert _native.cuda_pdl_enabled()
    assert len(runs[True]) == len(runs[False])
    for i, (a, b) in enumerate(zip(runs[True], runs[False])):
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}")


@pytest.mark.cuda
@needs_device
def test_chunked_causal_prefill_and_general_commit():
    cpu, gpu, cfg = pair("ds3_base", max_seq_len=128, max_tokens=16)
    assert gpu.max_tokens == 16
    ids = prompt(cfg.vocab_size, 45, seed=40)
    assert rel_to_scale(prefill(gpu, ids), prefill(cpu, ids)) < TOL   # 3 chunks
    assert_same_cache(cpu, gpu, cfg)
    parents, depths, vis = random_tree(17, seed=41)
    with pytest.raises(ValueError, match="max_tokens"):
        gpu.forward(prompt(cfg.vocab_size, 17, seed=42), 45 + depths, vis)
    assert gpu.cache_len == 45
    # a commit list that does not start at 0 (moves every kept row)
    toks = prompt(cfg.vocab_size, 9, seed=43)
    a, b = both(cpu, gpu, toks, 45 + np.arange(9))
    assert rel_to_scale(b, a) < TOL
    cpu.commit([2, 5, 8])
    gpu.commit([2, 5, 8])
    assert_same_cache(cpu, gpu, cfg)
    gpu.forward([1], [48])
    gpu.commit([])                      # keep nothing
    assert gpu.cache_len == 48


@pytest.mark.cuda
@needs_device
def test_uncommitted_forward_is_overwritten():
    _, gpu, cfg = pair("ds3_base")
    prefill(gpu, prompt(cfg.vocab_size, 8, seed=50))
    parents, depths, vis = random_tree(9, seed=51)
    toks = prompt(cfg.vocab_size, 9, seed=52)
    a = gpu.forward(toks, 8 + depths, vis)
    gpu.forward(prompt(cfg.vocab_size, 5, seed=53), 8 + np.arange(5))
    b = gpu.forward(toks, 8 + depths, vis.astype(np.uint8))
    np.testing.assert_array_equal(a, b)        # deterministic, and the dropped window is gone
    c = gpu.forward(toks, 8 + np.arange(9), np.tril(np.ones((9, 9), bool)))
    d = gpu.forward(toks, 8 + np.arange(9), None)
    np.testing.assert_array_equal(c, d)


@pytest.mark.cuda
@needs_device
def test_device_pointer_path_equals_host_path():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    _, gpu, cfg = pair("kimi_like")
    V = cfg.vocab_size
    ids = prompt(V, 12, seed=60)
    prefill(gpu, ids)
    parents, depths, vis = random_tree(33, seed=61)        # 33 nodes: the bitmask needs 1 word
    toks = prompt(V, 33, seed=62)
    pos = 12 + depths
    host = gpu.forward(toks, pos, vis)
    dev = torch.device("cuda")
    t_tok = torch.as_tensor(toks.astype(np.int32), device=dev)
    t_pos = torch.as_tensor(pos.astype(np.int32), device=dev)
    t_vis = torch.as_tensor(vis_bits(vis).view(np.int64), device=dev)
    t_out = torch.full((33, V), float("nan"), device=dev)
    torch.cuda.synchronize()
    gpu.forward_ptr(t_tok.data_ptr(), t_pos.data_ptr(), t_vis.data_ptr(), t_vis.shape[1], 33, t_out.data_ptr())
    np.testing.assert_array_equal(t_out.cpu().numpy(), host)
    keep = path_to(parents, int(np.argmax(depths)))
    t_keep = torch.as_tensor(np.asarray(keep, np.int32), device=dev)
    t_cnt = torch.as_tensor(np.asarray([len(keep)], np.int32), device=dev)
    torch.cuda.synchronize()
    gpu.commit_ptr(t_keep.data_ptr(), t_cnt.data_ptr())
    gpu.set_committed(len(keep))
    gpu.synchronize()
    rows = [gpu.read_cache(l, 0, gpu.cache_len) for l in range(cfg.num_hidden_layers)]
    # the same through the host path
    prefill(gpu, ids)
    gpu.forward(toks, pos, vis)
    gpu.commit(keep)
    for l in range(cfg.num_hidden_layers):
        np.testing.assert_array_equal(rows[l], gpu.read_cache(l, 0, gpu.cache_len))
    # causal device forward (vis_ptr 0) == host causal forward
    t_out2 = torch.empty((5, V), device=dev)
    t5 = torch.as_tensor(toks[:5].astype(np.int32), device=dev)
    p5 = torch.as_tensor((gpu.cache_len + np.arange(5)).astype(np.int32), device=dev)
    torch.cuda.synchronize()
    gpu.forward_ptr(t5.data_ptr(), p5.data_ptr(), 0, 0, 5, t_out2.data_ptr())
    np.testing.assert_array_equal(t_out2.cpu().numpy(), gpu.forward(toks[:5], gpu.cache_len + np.arange(5)))
    with pytest.raises(ValueError, match="device memory|CUDA pointer"):
        host_buf = np.zeros(5, np.int32)
        gpu.forward_ptr(host_buf.ctypes.data, p5.data_ptr(), 0, 0, 5, t_out2.data_ptr())
    with pytest.raises(ValueError, match="max_tokens"):
        gpu.forward_ptr(t5.data_ptr(), p5.data_ptr(), 0, 0, gpu.max_tokens + 1, t_out2.data_ptr())


@pytest.mark.cuda
@needs_device
def test_out_of_memory_at_construction_names_the_sizes():
    cfg = config_from_dict(config_dict(MLA512)).to_native()
    # 2 layers x 2^29 rows x 576 floats = 2.4 TB of latent cache
    with pytest.raises(RuntimeError, match=r"(?s)latent cache.*MiB.*max_seq_len"):
        _native.CudaModel(cfg, 1 << 29, max_tokens=64)
    m = _native.CudaModel(cfg, 64)          # the device is still usable afterwards
    assert m.memory_bytes == m.weight_bytes + m.cache_bytes + m.workspace_bytes > 0


@pytest.mark.cuda
@needs_device
def test_validation_errors():
    cpu, gpu, cfg = pair("ds3_base", max_seq_len=32)
    V = cfg.vocab_size
    with pytest.raises(ValueError, match="tokens"):
        gpu.forward([V], [0])
    with pytest.raises(ValueError, match="positions"):
        gpu.forward([1], [-1])
    with pytest.raises(ValueError, match="visibility: expected shape"):
        gpu.forward([1, 2], [0, 1], np.ones((3, 3), bool))
    with pytest.raises(ValueError, match="max_seq_len"):
        gpu.forward(np.zeros(33, np.int64), np.arange(33))
    gpu.forward([4, 5, 6], [0, 1, 2])
    with pytest.raises(ValueError, match="strictly increasing"):
        gpu.commit([1, 1])
    with pytest.raises(ValueError, match="keep"):
        gpu.commit([3])
    gpu.commit([0, 2])
    assert gpu.cache_len == 2
    with pytest.raises(ValueError, match="pending"):
        gpu.commit([0])
    with pytest.raises(ValueError, match="read_cache"):
        gpu.read_cache(0, 0, 3)
    fresh = _native.CudaModel(cfg.to_native(), 16)
    with pytest.raises(ValueError, match="not finalized"):
        fresh.forward([1], [0])
    with pytest.raises(ValueError, match="float32"):
        fresh.set_weight("model.norm.weight", np.ones(48))
    with pytest.raises(ValueError, match="unexpected tensor"):
        fresh.set_weight("model.layers.9.mlp.gate.weight", np.ones((8, 48), np.float32))
    with pytest.raises(ValueError, match="missing"):
        fresh.finalize()


# ---- HF parity on the GPU -------------------------------------------------------------------

def _gpu_from_checkpoint(path, max_seq_len):
    cfg = load_config(path)
    return load(_native.CudaModel(cfg.to_native(), max_seq_len), load_weights(path, cfg)), cfg


@pytest.mark.cuda
@pytest.mark.hf
@needs_device
@pytest.mark.parametrize("name", NAMES)
def test_prefill_logits_match_hf_on_gpu(name):
    path = cached_checkpoint(name)
    gpu, cfg = _gpu_from_checkpoint(path, 128)
    ids = prompt(cfg.vocab_size, 37, seed=len(name))
    assert rel_to_scale(prefill(gpu, ids), hf_logits(path, ids)) < TOL


@pytest.mark.cuda
@pytest.mark.hf
@needs_device
@pytest.mark.parametrize("name", NAMES)
def test_greedy_24_matches_hf_on_gpu(name):
    path = cached_checkpoint(name)
    gpu, cfg = _gpu_from_checkpoint(path, 64)
    ids = prompt(cfg.vocab_size, 9, seed=100 + len(name))
    nxt = int(np.argmax(prefill(gpu, ids)[-1]))
    ours = []
    for _ in range(24):
        ours.append(nxt)
        nxt = int(np.argmax(decode(gpu, nxt)))
    theirs = hf_greedy(path, ids, 24)
    assert ours == theirs.tolist(), f"{int((np.array(ours) == theirs).sum())}/24 tokens agree"


@pytest.mark.cuda
@needs_device
def test_engine_on_cuda_equals_cpu(tmp_path):
    """kn.Engine(device="cuda") builds the GPU model (when engine.py wires it) == device="cpu"."""
    cfg = config_from_dict(config_dict("kimi_like"))
    w = {k: v.astype(np.float32) for k, v in random_weights(cfg, 3).items()}
    try:
        eng = kn.Engine.from_weights(cfg, w, device="cuda", max_seq_len=64)
    except NotImplementedError as e:
        pytest.skip(f"Engine has no CUDA path yet: {e}")
    assert eng.device == "cuda" and eng.model.device == "cuda"
    ref = kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=64)
    ids = prompt(cfg.vocab_size, 20, seed=70)
    assert rel_to_scale(eng.prefill(ids), ref.prefill(ids)) < TOL
    assert rel_to_scale(eng.decode(5), ref.decode(5)) < TOL
    # cuda_options reach the GPU model: cuBLAS only, no graphs, a small max_tokens
    opt = kn.Engine.from_weights(cfg, w, device="cuda", max_seq_len=64,
                                 cuda_options={"skinny_max_tokens": 0, "tile_max_tokens": 0, "graphs": False,
                                               "max_tokens": 9})
    assert opt.model.max_tokens == 9
    assert rel_to_scale(opt.prefill(ids), ref.prefill(ids)) < TOL
    with pytest.raises(ValueError, match="skinny_max_tokens"):
        kn.Engine.from_weights(cfg, w, device="cuda", max_seq_len=64, cuda_options={"skinny_max_tokens": 99})


# ---- the attention's split merge inside the W_UV product (uv_combine) -----------------------

def _uv_reference(part, ml, w, T):
    """float64: o = sum_s 2^(m_s - max m) O_s / sum_s 2^(m_s - max m) l_s per row (0 where no split
    saw a key), then out[t, h] = o[t * H + h] @ w[h]^T."""
    m = ml[..., 0].astype(np.float64)
    mx = m.max(axis=0)
    wt = np.where(np.isneginf(m), 0.0, np.exp2(m - np.where(np.isneginf(mx), 0.0, mx)))
    den = (wt * ml[..., 1]).sum(axis=0)
    o = (wt[..., None] * part.astype(np.float64)).sum(axis=0)
    o = np.where(den[:, None] > 0, o / np.where(den > 0, den, 1.0)[:, None], 0.0)
    H = w.shape[0]
    return np.einsum("thc,hvc->thv", o.reshape(T, H, -1), w.astype(np.float64)).reshape(T, -1)


@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("T,S,H,Dv", [(1, 2, 16, 128), (1, 17, 16, 128), (2, 33, 4, 32), (4, 65, 16, 128),
                                      (8, 128, 2, 16), (3, 9, 128, 128)])
def test_uv_combine_kernel_matches_float64(T, S, H, Dv):
    """The split merge + W_UV kernel against float64, with splits that saw no key (max -inf, also
    every split of one row: that row's output is 0); the BF16-copy path equals the FP32 one bit
    for bit on BF16-exact weights."""
    from hf_models import to_bf16
    rng = np.random.default_rng(T * 1000 + S)
    M, C = T * H, 512
    part = rng.standard_normal((S, M, C)).astype(np.float32)
    ml = np.stack([rng.uniform(-8, 4, (S, M)), rng.uniform(0.5, 30, (S, M))], axis=-1).astype(np.float32)
    ml[rng.random((S, M)) < 0.2, 0] = -np.inf  # empty splits (their partials are ignored)
    part[np.isneginf(ml[..., 0])] = np.nan
    ml[np.isneginf(ml[..., 0]), 1] = 0.0
    ml[:, M - 1, 0] = -np.inf  # a row that saw nothing
    ml[:, M - 1, 1] = 0.0
    w = to_bf16((rng.standard_normal((H, Dv, C)) * 0.05).astype(np.float32))
    got = _native.cuda_uv_combine(part, ml, w, T)
    ref = _uv_reference(np.nan_to_num(part), ml, w, T)
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.all(got.reshape(T, H, Dv)[-1, -1] == 0.0)
    assert np.array_equal(_native.cuda_uv_combine(part, ml, w, T, w_bf16=True), got)
    with pytest.raises(ValueError):
        _native.cuda_uv_combine(part[:1], ml[:1], w, T)  # one split: nothing to merge


@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("attention_kernel", ["auto", "splitkv", "splitkv4", "mma", "tiled"])
def test_uv_combine_model_matches_cpu_and_separate_kernels(attention_kernel):
    """uv_combine_max_tokens (default 1: decode steps whose attention splits the keys merge the
    splits in the W_UV product; here 8, every size it takes) against the CPU model and against 0
    (the combine kernel, then the W_UV projection): decode and trees of 2-8 tokens at a context
    long enough for key splits, then a commit; caches within the parity bound."""
    cpu, gpu, cfg = pair(MLA512, max_seq_len=512, attention_kernel=attention_kernel, uv_combine_max_tokens=8)
    _, sep, _ = pair(MLA512, max_seq_len=512, attention_kernel=attention_kernel, uv_combine_max_tokens=0)
    ids = prompt(cfg.vocab_size, 400, seed=40)
    for m in (cpu, gpu, sep):
        prefill(m, ids)
    for T in (1, 2, 4, 8, 9):
        parents, depths, vis = random_tree(T, seed=41 + T)
        toks = prompt(cfg.vocab_size, T, seed=50 + T)
        pos = cpu.cache_len + depths
        a, b, c = cpu.forward(toks, pos, vis), gpu.forward(toks, pos, vis), sep.forward(toks, pos, vis)
        assert rel_to_scale(b, a) < TOL, f"T={T} vs CPU"
        assert rel_to_scale(b, c) < 1e-5, f"T={T} vs the separate kernels"
        keep = path_to(parents, int(np.argmax(depths)))
        for m in (cpu, gpu, sep):
            m.commit(keep)
    assert_same_cache(cpu, gpu, cfg)
    with pytest.raises(ValueError):
        _native.CudaModel(cfg.to_native(), 64, uv_combine_max_tokens=9)


@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("name", ["ds3_base", "neox_yarn_groups", "odd_sizes", "tied_nonorm"])
def test_combine_norm_same_bits_as_separate_kernels(name):
    """combine_norm (default on): past 4 tokens the RMSNorm after each MoE layer (the next layer's
    input norm, or the final one) runs inside the MoE combine kernel. Its logits and caches must be
    the bits of the separate rmsnorm kernel (combine_norm=False), at every step size the norms take
    as kernels (prefill, trees of 5-40 tokens) and at decode (where the norms sit in the projections
    either way), and within the parity bound of the CPU model."""
    cpu, gpu, cfg = pair(spec(name), max_seq_len=256)
    _, sep, _ = pair(spec(name), max_seq_len=256, combine_norm=False)
    ids = prompt(cfg.vocab_size, 70, seed=60)
    a, b, c = prefill(cpu, ids), prefill(gpu, ids), prefill(sep, ids)
    assert np.array_equal(b, c), "prefill"
    assert rel_to_scale(b, a) < TOL
    for T in (1, 5, 17, 40):
        parents, depths, vis = random_tree(T, seed=61 + T)
        toks = prompt(cfg.vocab_size, T, seed=70 + T)
        pos = cpu.cache_len + depths
        a, b, c = cpu.forward(toks, pos, vis), gpu.forward(toks, pos, vis), sep.forward(toks, pos, vis)
        assert np.array_equal(b, c), f"T={T}"
        assert rel_to_scale(b, a) < TOL, f"T={T} vs CPU"
        keep = path_to(parents, int(np.argmax(depths)))
        for m in (cpu, gpu, sep):
            m.commit(keep)
    assert_same_cache(cpu, gpu, cfg)
    for layer in range(cfg.num_hidden_layers):
        assert np.array_equal(gpu.read_cache(layer, 0, gpu.cache_len), sep.read_cache(layer, 0, sep.cache_len))
