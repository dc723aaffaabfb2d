"""The DDTree round on the GPU (cuda/engine/cuda_rounds.h, Generator(rounds="device")).

On a CUDA device (marker cuda; skipped without one), on random-weight models (the CPU model is
the oracle, run on the same weights):
* every drafter of the engine suite (oracle with noise, n-gram, a model drafter, all-wrong,
  duplicate ids, -inf columns, short drafts, logits drafts) generates exactly the tokens of
  greedy AR, with the same acceptance lengths and tree sizes as the host rounds on the same GPU
  model and as the CPU model;
* sampling (temperature, top-p, target top-k): the device sampler picks what the host sampler
  picks, and DDTree == AR with the same seed;
* budgets from 1 to the limit, the cache-capacity shrink of the last rounds, stop tokens,
  max_new_tokens edges, limits and errors (ValueError, the engine stays usable).
"""
import numpy as np
import pytest

import kdtree_native as kn
from kdtree_native import _native
from kdtree_native import reference as R
from kdtree_native.config import config_from_dict
from kdtree_native.drafters import ModelDrafter, NgramDrafter, OracleDrafter
from kdtree_native.generation import generate

from hf_models import config_dict, random_weights
from test_cuda_model import MLA512, load
from test_engine_loop import check_stats, drafter_zoo

HAS_MODEL = hasattr(_native, "CudaModel")
DEVICE_OK = HAS_MODEL and bool(_native.cuda_available()[0])
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not DEVICE_OK, reason="no CUDA device (or the GPU model is not built)")]

_MODELS = {}


def models(name, max_seq_len=320, seed=0):
    """(cpu model, cuda model, draft cpu model, cfg) on the same random weights."""
    key = (repr(name), max_seq_len, seed)
    if key not in _MODELS:
        cfg = config_from_dict(config_dict(name))
        w = {k: v.astype(np.float32) for k, v in random_weights(cfg, seed).items()}
        cpu = load(_native.CpuModel(cfg.to_native(), max_seq_len), w)
        gpu = load(_native.CudaModel(cfg.to_native(), max_seq_len), w)
        wd = {k: v.astype(np.float32) for k, v in random_weights(cfg, seed + 100).items()}
        draft = load(_native.CpuModel(cfg.to_native(), max_seq_len), wd)
        _MODELS[key] = (cpu, gpu, draft, cfg)
    return _MODELS[key]


def prompt_ids(vocab, n=12, seed=7):
    return np.random.default_rng(seed).integers(0, vocab, n)


CONFIGS = ["kimi_like", "ds3_base", MLA512]


@pytest.mark.parametrize("name", CONFIGS, ids=["kimi_like", "ds3_base", "mla512"])
def test_every_drafter_lossless_and_equal_to_host_rounds(name):
    cpu, gpu, draft, cfg = models(name)
    V = cfg.vocab_size
    P = prompt_ids(V)
    n = 40
    ar_dev = generate(gpu, P, n, seed=0)
    assert ar_dev.stats["rounds_on"] == "device"
    ar_cpu = generate(cpu, P, n, seed=0)
    np.testing.assert_array_equal(ar_dev.tokens, ar_cpu.tokens)
    zoo = drafter_zoo(ar_dev.tokens, V, len(P), draft)
    for dname, make in zoo.items():
        for budget, depth in [(1, 1), (7, 4), (48, 15)]:
            kw = dict(tree_budget=budget, depth=depth, seed=0)
            dev = generate(gpu, P, n, drafter=make(), **kw)
            host = generate(gpu, P, n, drafter=make(), rounds="host", **kw)
            ref = generate(cpu, P, n, drafter=make(), **kw)
            where = f"{dname} B={budget} D={depth}"
            assert host.stats["rounds_on"] == "host"
            np.testing.assert_array_equal(dev.tokens, ar_dev.tokens, err_msg=where)
            np.testing.assert_array_equal(dev.acceptance_lengths, host.acceptance_lengths, err_msg=where)
            np.testing.assert_array_equal(dev.acceptance_lengths, ref.acceptance_lengths, err_msg=where)
            assert dev.stats["num_draft_tokens"] == ref.stats["num_draft_tokens"], where
            check_stats(dev, depth)
            # the rounds' forwards timed on the GPU: positive, inside what the host waited for
            sd = dev.stats["seconds"]
            assert 0 < sd["verify_forward_gpu"] <= sd["verify"], (where, sd)
            assert host.stats["seconds"]["verify_forward_gpu"] == 0.0, where
    # a perfect oracle accepts whole chains
    r = generate(gpu, P, n, drafter=OracleDrafter(ar_dev.tokens, vocab_size=V), tree_budget=16, depth=15)
    np.testing.assert_array_equal(r.tokens, ar_dev.tokens)
    assert r.stats["mean_acceptance_length"] > 8


def test_adaptive_budget_on_device_rounds():
    """adaptive_budget=True with device rounds: every drafter == AR, greedy and sampled with one
    seed; the CUDA ModelDrafter's device drafts are read back for the choice (device_draft_to_host)."""
    cpu, gpu, draft, cfg = models("kimi_like")
    V = cfg.vocab_size
    P = prompt_ids(V)
    n = 40
    ar = generate(gpu, P, n, seed=0)
    for dname, make in drafter_zoo(ar.tokens, V, len(P), draft).items():
        for budget, depth in [(1, 1), (48, 15)]:
            res = generate(gpu, P, n, drafter=make(), tree_budget=budget, depth=depth, seed=0, adaptive_budget=True)
            assert res.stats["rounds_on"] == "device"
            np.testing.assert_array_equal(res.tokens, ar.tokens, err_msg=f"{dname} B={budget} D={depth}")
            check_stats(res, depth)
    res = generate(gpu, P, n, drafter=ModelDrafter(gpu_draft(cfg)), tree_budget=48, depth=6, seed=0,
                   adaptive_budget=True)
    np.testing.assert_array_equal(res.tokens, ar.tokens)
    assert res.stats["device_drafts"] > 0
    assert res.stats["mean_tree_size"] <= 48
    ars = generate(gpu, P, n, temperature=0.8, seed=3)
    for drafter in (NgramDrafter(), OracleDrafter(ars.tokens, 0.3, vocab_size=V), ModelDrafter(gpu_draft(cfg))):
        res = generate(gpu, P, n, drafter=drafter, tree_budget=32, depth=6, temperature=0.8, seed=3,
                       adaptive_budget=True)
        np.testing.assert_array_equal(res.tokens, ars.tokens)


def test_model_drafter_device_topk():
    """host_topk (what the adaptive budget asks a drafter for): the GPU ModelDraft returns the [d, k] form
    from its device top-k, copied back with the rows' statistics, bit for bit the device top-k of the
    logits it returns without host_topk (the same chain: the call truncates back to the context) and
    the reference's ids; the rows min_chain_prob keeps are the same; depth > 16 keeps the logits."""
    cpu, gpu, draft, cfg = models("kimi_like")
    V = cfg.vocab_size
    P = prompt_ids(V).astype(np.int32)
    model = gpu_draft(cfg)
    cases = [(P, 6, 8), (P, 16, 5), (np.concatenate([P, [3, 4, 5]]).astype(np.int32), 15, 64), (P[:3], 4, V + 7),
             (P, 1, 1)]
    for mcp in (0.0, 0.3):
        nd = _native.ModelDraft(model, min_chain_prob=mcp)
        kept = []
        for ctx, depth, k in cases:
            nd(ctx, depth, 8)  # the cache holds ctx: the two calls below feed the same last token
            logits = nd(ctx, depth, 8)
            lp, ids = nd(ctx, depth, 8, host_topk=k)
            kk = min(k, V)
            assert lp.shape == ids.shape == (logits.shape[0], kk) and lp.dtype == np.float32 and ids.dtype == np.int32
            lp_g, ids_g = kn.ops.topk_logsoftmax(logits, kk, device="cuda")
            np.testing.assert_array_equal(ids, ids_g)
            np.testing.assert_array_equal(lp, lp_g)
            np.testing.assert_array_equal(ids, R.topk_logsoftmax(logits, kk)[1])
            kept.append(logits.shape[0])
        assert (mcp == 0.0) == all(d == depth for d, (_, depth, _) in zip(kept, cases)), kept
    nd = _native.ModelDraft(model, min_chain_prob=0.0)
    assert nd(P, 17, 8, host_topk=8).shape == (17, V)  # beyond the device top-k's rows: the logits
    with pytest.raises(ValueError, match="host_topk"):
        nd(P, 4, 8, host_topk=-1)
    # in generate (adaptive budget), on both round paths: the draft comes back in [d, k] form
    # (device_drafts counts those rounds; host rounds copied the [d, V] logits back before)
    ar = generate(gpu, P, 30, seed=0)
    for rounds in ("device", "host"):
        res = generate(gpu, P, 30, drafter=ModelDrafter(model), tree_budget=32, depth=8, seed=0,
                       adaptive_budget=True, rounds=rounds)
        np.testing.assert_array_equal(res.tokens, ar.tokens)
        assert res.stats["device_drafts"] >= int((res.tree_sizes > 0).sum()) > 0, rounds
        fixed = generate(gpu, P, 30, drafter=ModelDrafter(model), tree_budget=32, depth=8, seed=0, rounds=rounds)
        np.testing.assert_array_equal(fixed.tokens, ar.tokens)
        assert fixed.stats["device_drafts"] == (int((fixed.tree_sizes > 0).sum()) if rounds == "device" else 0), rounds


@pytest.mark.parametrize("rounds", ["device", "host"])
def test_reuse_prefix_on_the_gpu(rounds):
    """reuse_prefix=True with a CUDA model (its cache epoch; CudaRounds::prefill truncates to the kept
    entries): the second turn keeps the first's entries and gives a fresh call's tokens; a forward
    in between disables it."""
    cpu, gpu, draft, cfg = models("kimi_like")
    P = prompt_ids(cfg.vocab_size)
    for kw in ({}, dict(drafter=NgramDrafter(), tree_budget=8, depth=4)):
        generate(gpu, P, 4, rounds=rounds)   # (another prompt last: the first turn below reuses nothing)
        a = generate(gpu, np.concatenate([[5], P]), 12, reuse_prefix=True, rounds=rounds, **kw)
        assert a.stats["prefill_reused"] == 0
        p2 = np.concatenate([[5], P, a.tokens, [5, 6, 7]])
        b = generate(gpu, p2, 12, reuse_prefix=True, rounds=rounds, **kw)
        assert b.stats["prefill_reused"] == len(P) + 1 + 12 - 1   # (the first turn's last token was never cached)
        fresh = generate(gpu, p2, 12, rounds=rounds, **kw)
        np.testing.assert_array_equal(b.tokens, fresh.tokens)
        np.testing.assert_array_equal(b.tokens, generate(cpu, p2, 12, **kw).tokens)
        gpu.forward(np.array([1], np.int32), np.array([gpu.cache_len], np.int32), None)
        c = generate(gpu, p2, 12, reuse_prefix=True, rounds=rounds, **kw)
        assert c.stats["prefill_reused"] == 0
        np.testing.assert_array_equal(c.tokens, fresh.tokens)


def gpu_draft(cfg, max_seq_len=320, seed=100):
    """A CudaModel drafter (its drafts stay in device memory)."""
    w = {k: v.astype(np.float32) for k, v in random_weights(cfg, seed).items()}
    return load(_native.CudaModel(cfg.to_native(), max_seq_len), w)


@pytest.mark.parametrize("temperature,top_p,target_top_k", [(0.8, 1.0, 0), (1.3, 0.9, 0), (0.7, 1.0, 20),
                                                             (1.0, 0.5, 5)])
def test_sampling_device_equals_host_and_ar(temperature, top_p, target_top_k):
    cpu, gpu, draft, cfg = models("kimi_like")
    V = cfg.vocab_size
    P = prompt_ids(V, seed=3)
    kw = dict(temperature=temperature, top_p=top_p, target_top_k=target_top_k or None, seed=1234)
    ar = generate(gpu, P, 48, **kw)
    ar_host = generate(gpu, P, 48, rounds="host", **kw)
    np.testing.assert_array_equal(ar.tokens, ar_host.tokens)
    ar_cpu = generate(cpu, P, 48, **kw)
    np.testing.assert_array_equal(ar.tokens, ar_cpu.tokens)
    for d in [NgramDrafter(), OracleDrafter(ar.tokens, 0.3, seed=5, vocab_size=V), ModelDrafter(draft)]:
        r = generate(gpu, P, 48, drafter=d, tree_budget=24, depth=6, **kw)
        np.testing.assert_array_equal(r.tokens, ar.tokens)
    other = generate(gpu, P, 48, **dict(kw, seed=99))
    assert not np.array_equal(other.tokens, ar.tokens)  # the seed matters


def test_edges_stop_tokens_and_capacity():
    cpu, gpu, draft, cfg = models("kimi_like", max_seq_len=64)
    V = cfg.vocab_size
    P = prompt_ids(V, 10, seed=11)
    ar = generate(cpu, P, 54)
    oracle = lambda: OracleDrafter(ar.tokens, 0.2, seed=3, vocab_size=V)
    # fills the cache exactly: the last rounds shrink the tree to what still fits
    r = generate(gpu, P, 54, drafter=oracle(), tree_budget=32, depth=15)
    np.testing.assert_array_equal(r.tokens, ar.tokens)
    for m in [0, 1, 2, 3]:
        r = generate(gpu, P, m, drafter=oracle(), tree_budget=8, depth=4)
        np.testing.assert_array_equal(r.tokens, ar.tokens[:m])
    stop = int(ar.tokens[20])
    first = int(np.flatnonzero(ar.tokens == stop)[0])
    r = generate(gpu, P, 54, drafter=oracle(), tree_budget=32, depth=15, stop_token_ids=[stop])
    assert r.stopped
    np.testing.assert_array_equal(r.tokens, ar.tokens[:first + 1])
    with pytest.raises(ValueError):
        generate(gpu, P, 60, drafter=oracle())  # exceeds max_seq_len


def test_limits_and_errors_leave_the_engine_usable():
    cpu, gpu, draft, cfg = models("kimi_like")
    V = cfg.vocab_size
    P = prompt_ids(V, seed=5)
    ar = generate(gpu, P, 20)
    with pytest.raises(ValueError, match="depth"):
        generate(gpu, P, 20, drafter=NgramDrafter(), depth=17)
    with pytest.raises(ValueError, match="tree_budget"):
        generate(gpu, P, 20, drafter=NgramDrafter(), tree_budget=2000)

    class Boom(RuntimeError):
        pass

    def bad(ctx, depth, top_k):
        raise Boom("drafter failed")

    with pytest.raises(Boom):
        generate(gpu, P, 20, drafter=bad)

    def nan_draft(ctx, depth, top_k):
        lp = np.full((depth, 2), -1.0, np.float32)
        lp[0, 1] = np.nan
        return lp, np.zeros((depth, 2), np.int32)

    with pytest.raises(ValueError, match="NaN"):
        generate(gpu, P, 20, drafter=nan_draft)

    def bad_id(ctx, depth, top_k):
        return np.zeros((1, 1), np.float32), np.array([[V]], np.int32)

    with pytest.raises(ValueError, match="outside the vocab"):
        generate(gpu, P, 20, drafter=bad_id)
    again = generate(gpu, P, 20, drafter=NgramDrafter())
    np.testing.assert_array_equal(again.tokens, ar.tokens)
    with pytest.raises(ValueError, match="rounds"):
        generate(gpu, P, 4, rounds="gpu")
    with pytest.raises(ValueError, match="CudaModel"):
        generate(cpu, P, 4, rounds="device")


def test_long_prompt_prefill_chunks_and_logits_top_k():
    cpu, gpu, draft, cfg = models("ds3_base", max_seq_len=320)
    V = cfg.vocab_size
    P = prompt_ids(V, 150, seed=2)
    ar = generate(cpu, P, 30, prefill_chunk=64)
    r = generate(gpu, P, 30, prefill_chunk=64)
    np.testing.assert_array_equal(r.tokens, ar.tokens)
    rng = np.random.default_rng(0)
    logits = lambda ctx, depth, top_k: rng.standard_normal((depth, V)).astype(np.float32) * 4
    r = generate(gpu, P, 30, drafter=logits, tree_budget=40, depth=6, top_k=5, prefill_chunk=50)
    np.testing.assert_array_equal(r.tokens, ar.tokens)


def test_graph_replays_equal_eager_across_context_buckets():
    """forward_device replays CUDA graphs (L read on the device, grid sized for the context
    bucket); across the 256 -> 512 bucket boundary the tokens equal an eager GPU model's and the
    CPU model's, and the per-step logits agree within the parity tolerance."""
    cfg = config_from_dict(config_dict(MLA512))
    w = {k: v.astype(np.float32) for k, v in random_weights(cfg, 21).items()}
    g = load(_native.CudaModel(cfg.to_native(), 600), w)
    e = load(_native.CudaModel(cfg.to_native(), 600, graphs=False), w)
    c = load(_native.CpuModel(cfg.to_native(), 600), w)
    P = prompt_ids(cfg.vocab_size, 200, seed=8)
    ref = generate(c, P, 120)
    a = generate(g, P, 120)
    b = generate(e, P, 120)
    np.testing.assert_array_equal(a.tokens, ref.tokens)
    np.testing.assert_array_equal(b.tokens, ref.tokens)
    assert g.graph_captures >= 2 and g.graph_replays >= 100  # the 256 and 512 buckets
    assert e.graph_captures == 0 and e.graph_replays == 0
    d = generate(g, P, 120, drafter=NgramDrafter(), tree_budget=16, depth=6)
    np.testing.assert_array_equal(d.tokens, ref.tokens)
    # logits of graph replays vs the CPU model (host path) at a context in the 512 bucket
    for m in (g, c):
        m.reset()
        m.forward(P, np.arange(len(P)), None)
        m.commit(np.arange(len(P)))
    import torch  # the device path needs device buffers; torch is on every GPU test machine

    dev = torch.device("cuda")
    logits = torch.empty((1, cfg.vocab_size), device=dev)
    tok = torch.zeros(1, dtype=torch.int32, device=dev)
    pos = torch.zeros(1, dtype=torch.int32, device=dev)
    for step in range(70):
        t = int(ref.tokens[step])
        L = g.cache_len
        tok.fill_(t)
        pos.fill_(L)
        g.forward_ptr(tok.data_ptr(), pos.data_ptr(), 0, 0, 1, logits.data_ptr(), True)
        g.set_committed(1)
        lc = c.forward([t], [L], None)
        c.commit([0])
        got = logits.cpu().numpy()
        assert np.abs(got - lc).max() <= 1e-4 * np.abs(lc).max(), f"step {step}, L {L}"


def test_engine_api_and_torch_device_drafts():
    """kn.Engine(device="cuda") end to end with a ModelDrafter over another Engine, and a
    drafter that returns torch CUDA tensors ([d,k] and [d,V] logits): same tokens as AR."""
    torch = pytest.importorskip("torch")
    import kdtree_native as kn

    cfg = config_from_dict(config_dict("kimi_like"))
    w = {k: v.astype(np.float32) for k, v in random_weights(cfg, 4).items()}
    wd = {k: v.astype(np.float32) for k, v in random_weights(cfg, 9).items()}
    eng = kn.Engine.from_weights(cfg, w, device="cuda", max_seq_len=160)
    deng = kn.Engine.from_weights(cfg, wd, device="cuda", max_seq_len=160)
    ref = kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=160)
    P = prompt_ids(cfg.vocab_size, 16, seed=4)
    ar = ref.generate(P, 40)
    r = eng.generate(P, 40, drafter=ModelDrafter(deng), tree_budget=16, depth=5)
    np.testing.assert_array_equal(r.tokens, ar.tokens)
    assert r.stats["rounds_on"] == "device"
    oracle = OracleDrafter(ar.tokens, 0.3, seed=2, vocab_size=cfg.vocab_size)

    def torch_draft(ctx, depth, top_k):
        out = oracle.draft(ctx, depth, top_k)
        if out is None:
            return None
        lp, ids = out
        return torch.as_tensor(lp, device="cuda"), torch.as_tensor(ids.astype(np.int64), device="cuda")

    r = eng.generate(P, 40, drafter=torch_draft, tree_budget=16, depth=8, top_k=4)
    np.testing.assert_array_equal(r.tokens, ar.tokens)
    assert r.stats["mean_acceptance_length"] > 1.2
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = lambda ctx, depth, top_k: torch.randn((depth, cfg.vocab_size), device="cuda", generator=g)
    r = eng.generate(P, 40, drafter=logits, tree_budget=8, depth=4)
    np.testing.assert_array_equal(r.tokens, ar.tokens)


def _logit_rows(rng, kind, T, V):
    if kind == "normal":
        return rng.standard_normal((T, V)).astype(np.float32) * 3
    if kind == "peaked":
        x = rng.standard_normal((T, V)).astype(np.float32)
        x[:, rng.integers(0, V, T)] += 12
        return x
    if kind == "ties":
        return rng.integers(-3, 3, (T, V)).astype(np.float32)
    if kind == "flat":
        return np.zeros((T, V), np.float32) + rng.standard_normal((T, 1)).astype(np.float32)
    if kind == "special":
        x = rng.standard_normal((T, V)).astype(np.float32)
        m = rng.random((T, V))
        x[m < 0.05] = -np.inf
        x[(m >= 0.05) & (m < 0.08)] = np.nan
        x[0, :] = np.nan                      # all NaN
        if T > 1:
            x[1, :] = -np.inf                 # nothing finite
        if T > 2:
            x[2, V // 2] = np.inf             # +inf
        if T > 3:
            x[3, :] = 0.0
            x[3, ::2] = -0.0                  # -0 vs +0
        return x
    raise ValueError(kind)


@pytest.mark.parametrize("V", [1, 7, 300, 32000, 163840])
def test_choose_tokens_equals_the_host_sampler(V):
    """The GPU round's per-node choice == the host Sampler (cpp/engine/sampler.h), greedy and
    sampled (temperature, target top-k, top-p), on awkward rows: ties, NaN, +-inf, -0/+0, flat."""
    rng = np.random.default_rng(V)
    T = 24 if V < 100000 else 6
    settings = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.9, 40, 0.8), (2.0, 0, 0.3),
                (0.5, 1, 1.0), (1.0, V + 3, 0.999)]
    for kind in ["normal", "peaked", "ties", "flat", "special"]:
        x = _logit_rows(rng, kind, T, V)
        pos = rng.integers(0, 10000, T).astype(np.int32)
        for temperature, top_k, top_p in settings:
            for seed in (0, 77):
                want = _native.sampler_choose(x, pos.astype(np.int64), temperature, top_k, top_p, seed)
                got = _native.cuda_choose_tokens(x, pos, temperature, top_k, top_p, seed)
                assert (got >= 0).all() and (got < V).all()
                np.testing.assert_array_equal(got, want, err_msg=f"{kind} T={temperature} k={top_k} p={top_p}")


def _cuda_copies(name, seed, max_seq_len, copies=2):
    cfg = config_from_dict(config_dict(name))
    w = {k: v.astype(np.float32) for k, v in random_weights(cfg, seed).items()}
    return [load(_native.CudaModel(cfg.to_native(), max_seq_len), w) for _ in range(copies)], cfg, w


@pytest.mark.parametrize("mcp", [0.0, 0.5])
@pytest.mark.parametrize("name", ["kimi_like", MLA512], ids=["kimi_like", "mla512"])
def test_native_model_drafter_chain_on_the_gpu(name, mcp):
    """The GPU chain (cuda/engine/cuda_model_drafter: draft_row kernels and graph-replayed T = 1
    steps, no host synchronisation between them) against the Python definition (native=False) on a
    second copy of the same CUDA model, which runs the model's host forward(): the same rows bit
    for bit through growing contexts, rollbacks, new prompts and contexts past max_seq_len."""
    from test_drafters import model_draft_walk

    (ma, mb), cfg, _ = _cuda_copies(name, 21, 64)
    a = ModelDrafter(ma, min_chain_prob=mcp, prefill_chunk=7)
    b = ModelDrafter(mb, min_chain_prob=mcp, prefill_chunk=7, native=False)
    assert a._native is not None and b._native is None
    assert model_draft_walk(a, b, cfg.vocab_size, 64, seed=3, steps=60, depths=(1, 9)) > 30
    assert ma.graph_replays > 0  # the chain's steps were replayed from graphs


def test_native_model_drafter_in_gpu_and_host_rounds():
    """A CUDA draft model's native chain inside generate: its logits stay on the device in the GPU
    round (and are copied to the host for host rounds); the same tokens as AR, and the same
    acceptance lengths as the Python definition of the drafter on a copy of the draft model, so
    the round built its trees from the right rows."""
    cpu, gpu, _, cfg = models("kimi_like")
    V = cfg.vocab_size
    (da, db), _, wd = _cuda_copies("kimi_like", 100, 320)
    P = prompt_ids(V, 14, seed=5)
    for kw in [dict(seed=0), dict(temperature=0.9, seed=77)]:
        ar = generate(cpu, P, 48, **kw)
        for mcp, budget, depth in [(0.0, 12, 5), (0.2, 24, 8), (0.0, 1, 1)]:
            where = f"{kw} mcp={mcp} B={budget} D={depth}"
            ref = generate(gpu, P, 48, drafter=ModelDrafter(db, min_chain_prob=mcp, native=False),
                           tree_budget=budget, depth=depth, **kw)
            for rounds in ["device", "host"]:
                r = generate(gpu, P, 48, drafter=ModelDrafter(da, min_chain_prob=mcp), tree_budget=budget,
                             depth=depth, rounds=rounds, **kw)
                np.testing.assert_array_equal(r.tokens, ar.tokens, err_msg=where + rounds)
                np.testing.assert_array_equal(r.acceptance_lengths, ref.acceptance_lengths, err_msg=where + rounds)
                assert r.stats["num_draft_tokens"] == ref.stats["num_draft_tokens"], where + rounds
    # a CUDA draft model for a CPU target: host arrays
    r = generate(cpu, P, 48, drafter=ModelDrafter(da), tree_budget=12, depth=5)
    np.testing.assert_array_equal(r.tokens, generate(cpu, P, 48).tokens)


def test_native_model_drafter_errors_on_the_gpu():
    cpu, gpu, _, cfg = models("kimi_like")
    V = cfg.vocab_size
    P = prompt_ids(V, 10, seed=6)
    ar = generate(gpu, P, 20)
    with pytest.raises(ValueError, match="target model itself"):
        generate(gpu, P, 20, drafter=ModelDrafter(gpu), tree_budget=8, depth=4)
    _, _, wd = _cuda_copies("kimi_like", 100, 320, copies=0)
    wd["lm_head.weight"] = wd["lm_head.weight"].copy()
    wd["lm_head.weight"][3] = np.nan  # logit 3 of every row is NaN
    with pytest.raises(ValueError, match=r"'lm_head.weight' holds NaN at flat index"):
        load(_native.CudaModel(cfg.to_native(), 320), wd)
    bad = load(_native.CudaModel(cfg.to_native(), 320), wd, check_finite=False)
    for rounds in ["device", "host"]:
        with pytest.raises(ValueError, match=r"NaN \(row 0\)"):
            generate(gpu, P, 20, drafter=ModelDrafter(bad), tree_budget=8, depth=4, rounds=rounds)
        np.testing.assert_array_equal(generate(gpu, P, 20, rounds=rounds).tokens, ar.tokens)
    with pytest.raises(ValueError, match="outside the draft model's vocab"):
        ModelDrafter(bad).draft(np.array([0, V], np.int32), 2, 4)
