"""Drafts in GPU memory from Python drafters (bindings/bind_engine.cpp take_device_draft,
CudaRounds::check_device_draft): a drafter that returns torch CUDA tensors (read through their
__cuda_array_interface__, v2), or objects with only __cuda_array_interface__ (v3 with a stream,
v2 without) or only DLPack, has its draft
read in place by the GPU round (stats["device_drafts"] counts those rounds), checked on the device
with the host check's messages, and ordered after the producer's stream.

On a CUDA device with torch (marker cuda; skipped otherwise). The oracle of every token is the
same model's greedy AR; the oracle of every error message is the same draft as numpy arrays.
"""
import numpy as np
import pytest

from kdtree_native import _native
from kdtree_native.drafters import OracleDrafter
from kdtree_native.generation import generate

from test_cuda_rounds import DEVICE_OK, models, prompt_ids

torch = pytest.importorskip("torch") if DEVICE_OK else None
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not DEVICE_OK or torch is None or not torch.cuda.is_available(),
                                 reason="no CUDA device, GPU model or torch with CUDA")]


class CAIOnly:
    """A device array seen only through __cuda_array_interface__ (as CuPy / Numba export it)."""

    def __init__(self, t, stream=None, version=3):
        self.t = t  # keeps the memory alive
        d = dict(shape=tuple(t.shape), typestr=t.__cuda_array_interface__["typestr"], data=(t.data_ptr(), False),
                 version=version, strides=None)
        if version >= 3:
            d["stream"] = stream
        self.__cuda_array_interface__ = d


class DLPackOnly:
    """A device array seen only through DLPack (__dlpack__ / __dlpack_device__)."""

    def __init__(self, t):
        self.t = t
        self.exports = 0

    def __dlpack__(self, stream=None):
        self.exports += 1
        return self.t.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def _setup(n=40):
    cpu, gpu, draft, cfg = models("kimi_like")
    V = cfg.vocab_size
    P = prompt_ids(V, 14, seed=21)
    ar = generate(gpu, P, n)
    return gpu, cfg, V, P, ar


def _oracle(ar, V, noise=0.3):
    return OracleDrafter(ar.tokens, noise, seed=5, vocab_size=V)


@pytest.mark.parametrize("wrap", ["torch_int64", "torch_int32", "cai_v3", "cai_v2", "dlpack_only", "list"])
def test_logprob_drafts_stay_on_the_gpu(wrap):
    """[d, k] log-probs + ids as device arrays of every protocol: the GPU round takes them in place
    (device_drafts == drafted rounds), and the tokens, acceptance lengths and tree sizes equal the
    same drafter's numpy output."""
    gpu, cfg, V, P, ar = _setup()
    dev = torch.device("cuda")
    side = torch.cuda.Stream()

    drafts = {}

    def make(kind):
        orc = _oracle(ar, V)
        drafts[kind] = 0

        def fn(ctx, depth, top_k):
            out = orc.draft(ctx, depth, top_k)
            if out is None or kind == "numpy":
                return out
            drafts[kind] += 1
            lp, ids = out
            if kind == "torch_int32":
                return torch.as_tensor(lp, device=dev), torch.as_tensor(ids.astype(np.int32), device=dev)
            tl, ti = torch.as_tensor(lp, device=dev), torch.as_tensor(ids.astype(np.int64), device=dev)
            if kind == "torch_int64":
                return tl, ti
            if kind == "list":
                return [tl, ti]
            if kind == "cai_v3":  # the producer names a side stream that has waited for the copies
                side.wait_stream(torch.cuda.current_stream(dev))
                return CAIOnly(tl, side.cuda_stream), CAIOnly(ti, side.cuda_stream)
            if kind == "cai_v2":
                return CAIOnly(tl, version=2), CAIOnly(ti, version=2)
            return DLPackOnly(tl), DLPackOnly(ti)
        return fn

    ref = generate(gpu, P, 40, drafter=make("numpy"), tree_budget=16, depth=6, top_k=4)
    got = generate(gpu, P, 40, drafter=make(wrap), tree_budget=16, depth=6, top_k=4)
    np.testing.assert_array_equal(ref.tokens, ar.tokens)
    np.testing.assert_array_equal(got.tokens, ar.tokens)
    np.testing.assert_array_equal(got.acceptance_lengths, ref.acceptance_lengths)
    assert got.stats["num_draft_tokens"] == ref.stats["num_draft_tokens"]
    assert drafts[wrap] >= 5
    assert ref.stats["device_drafts"] == 0
    assert got.stats["device_drafts"] == drafts[wrap]


def test_logits_drafts_stay_on_the_gpu_and_equal_numpy():
    """[d, V] logits as a torch CUDA tensor (and as CAI / DLPack-only objects): read in place by
    the device top-k; the same trees and tokens as the same logits given as numpy."""
    gpu, cfg, V, P, ar = _setup()
    rng_seed = 3
    drafts = {}

    def make(kind):
        g = torch.Generator(device="cuda").manual_seed(rng_seed)
        drafts[kind] = 0

        def fn(ctx, depth, top_k):
            drafts[kind] += 1
            x = torch.randn((depth, V), device="cuda", generator=g) * 4
            x[:, int(ctx[-1]) % V] += 3.0
            if depth > 1:
                x[1, ::3] = float("-inf")  # -inf entries: finite counts below V
            if kind == "numpy":
                return x.cpu().numpy()
            if kind == "cai":  # v3 naming the stream torch wrote on (0 = the legacy default: 1)
                return CAIOnly(x, stream=torch.cuda.current_stream().cuda_stream or 1)
            if kind == "dlpack":
                return DLPackOnly(x)
            return x
        return fn

    ref = generate(gpu, P, 40, drafter=make("numpy"), tree_budget=12, depth=4)
    for kind in ("torch", "cai", "dlpack"):
        got = generate(gpu, P, 40, drafter=make(kind), tree_budget=12, depth=4)
        np.testing.assert_array_equal(got.tokens, ar.tokens)
        np.testing.assert_array_equal(got.acceptance_lengths, ref.acceptance_lengths)
        assert got.stats["num_draft_tokens"] == ref.stats["num_draft_tokens"]
        assert got.stats["device_drafts"] == drafts[kind] > 0
    assert ref.stats["device_drafts"] == 0


@pytest.mark.parametrize("form", ["logprobs_int64", "logprobs_int32", "logits"])
def test_adaptive_budget_reads_device_drafts(form):
    """adaptive_budget=True with device drafts: the policy reads the draft's [d, k] form copied back
    (CudaRounds::device_draft_to_host; the device top-k for logits). A sure, right draft on the
    device (a noise-free oracle; logits with the right token +12 over N(0, 2^2)): == AR, and whole
    chains accepted (ids read back wrong would accept nothing, log-probs read back wrong would not
    pick the chain; H200: the [d, k] forms choose the 15-node chain and accept 16 a round), while
    the sizes are chosen (the typical drafted round well under the ceiling of 48 a fixed budget
    fills)."""
    gpu, cfg, V, P, ar = _setup(n=80)
    dev = torch.device("cuda")
    seq = np.concatenate([P, ar.tokens])
    orc = OracleDrafter(ar.tokens, 0.0, seed=5, vocab_size=V)
    count = [0]

    def fn(ctx, depth, top_k):
        n = len(ctx)
        if form == "logits":
            d = min(depth, len(seq) - n)
            if d <= 0:
                return None
            g = torch.Generator(device="cuda").manual_seed(n)
            x = torch.randn((d, V), device=dev, generator=g) * 2
            x[torch.arange(d, device=dev), torch.as_tensor(seq[n:n + d], device=dev)] += 12
            count[0] += 1
            return x
        out = orc.draft(ctx, depth, top_k)
        if out is None:
            return None
        count[0] += 1
        lp, ids = out
        return (torch.as_tensor(lp, device=dev),
                torch.as_tensor(ids.astype(np.int32 if form == "logprobs_int32" else np.int64), device=dev))

    res = generate(gpu, P, 80, drafter=fn, tree_budget=48, depth=15, top_k=8, adaptive_budget=True)
    np.testing.assert_array_equal(res.tokens, ar.tokens)
    assert res.stats["device_drafts"] == count[0] > 0
    # every drafted round's depth-1 node accepted, and chains beyond it (ids read back wrong: none)
    assert res.stats["per_position_acceptance_rate"][:2] == [1.0, 1.0], res.stats
    assert res.stats["mean_acceptance_length"] > 4, res.stats
    sizes = res.tree_sizes
    assert len(sizes) == res.stats["rounds"] and sizes.max() <= 48
    # chosen: the typical drafted round verifies about the chain, not the ceiling a fixed budget fills
    assert np.median(sizes[sizes > 0]) < 40, sizes


def test_the_round_waits_for_the_producer():
    """The draft is written by the producer only after a ~20 ms GPU sleep; before it the memory
    holds NaN. The check kernel runs on the model's own (non-blocking) stream, so the draft is
    read correctly only if the engine waits: for the legacy default stream DLPack exported for
    (torch's default stream, a DLPack-only wrapper), for CAI v3's stream (a side stream), or the
    device-wide wait of CAI v2 (torch tensors themselves, and a side stream)."""
    gpu, cfg, V, P, ar = _setup(24)
    side = torch.cuda.Stream()
    cycles = 40_000_000

    def make(kind):
        orc = _oracle(ar, V, 0.2)

        def fn(ctx, depth, top_k):
            out = orc.draft(ctx, depth, top_k)
            if out is None:
                return None
            lp, ids = out
            stream = side if kind in ("cai_v3", "cai_v2") else torch.cuda.current_stream()  # default
            src_lp = torch.as_tensor(lp).pin_memory()
            src_ids = torch.as_tensor(ids.astype(np.int64)).pin_memory()
            with torch.cuda.stream(stream):
                tl = torch.full(lp.shape, float("nan"), device="cuda")
                ti = torch.full(ids.shape, -1, dtype=torch.int64, device="cuda")
                torch.cuda._sleep(cycles)
                tl.copy_(src_lp, non_blocking=True)
                ti.copy_(src_ids, non_blocking=True)
            if kind == "torch":
                return tl, ti
            if kind == "dlpack":
                return DLPackOnly(tl), DLPackOnly(ti)
            if kind == "cai_v3":
                return CAIOnly(tl, side.cuda_stream), CAIOnly(ti, side.cuda_stream)
            return CAIOnly(tl, version=2), CAIOnly(ti, version=2)
        return fn

    for kind in ("torch", "dlpack", "cai_v3", "cai_v2"):
        got = generate(gpu, P, 24, drafter=make(kind), tree_budget=8, depth=4, top_k=3)
        np.testing.assert_array_equal(got.tokens, ar.tokens)
        assert got.stats["device_drafts"] >= 3, kind
    torch.cuda.synchronize()


def _bad_drafts(V):
    lp = np.log(np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.7, 0.2, 0.1]], np.float32))
    ids = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.int64)
    cases = []
    x = lp.copy(); x[1, 2] = np.nan; cases.append(("nan", x, ids))
    x = lp.copy(); x[2, 0] = np.inf; cases.append(("+inf", x, ids))
    x = lp.copy(); x[1, 1] = 0.0; cases.append(("unsorted", x, ids))
    i = ids.copy(); i[2, 1] = V + 5; cases.append(("id_high", lp, i))
    i = ids.copy(); i[0, 2] = -3; cases.append(("id_negative", lp, i))
    x = lp.copy(); x[1, 0] = np.nan; i = ids.copy(); i[1, 2] = V; cases.append(("nan_before_bad_id", x, i))
    x = lp.copy(); x[0, 1] = np.nan; x[0, 2] = np.nan; cases.append(("first_of_two", x, ids))
    return cases


def test_device_draft_errors_match_the_host_checks_and_leave_the_engine_usable():
    """Each bad draft raises ValueError with exactly the message of the same draft as numpy (the
    host checks), and the next generate on the same model is correct."""
    gpu, cfg, V, P, ar = _setup(16)
    for name, lp, ids in _bad_drafts(V):
        for ids_dtype in (np.int64, np.int32):
            msgs = []
            for kind in ("numpy", "device"):
                def fn(ctx, depth, top_k, kind=kind, ids_dtype=ids_dtype):
                    d = min(depth, lp.shape[0])
                    a, b = lp[:d], ids[:d].astype(ids_dtype)
                    if kind == "numpy":
                        return a, b
                    return torch.as_tensor(a, device="cuda"), torch.as_tensor(b, device="cuda")
                with pytest.raises(ValueError) as ei:
                    generate(gpu, P, 8, drafter=fn, tree_budget=8, depth=4, top_k=3)
                msgs.append(str(ei.value))
            if name == "nan_before_bad_id":
                # the host path converts the ids first (parse_draft) and names the id; the
                # device check names the first fault in row order: both are ValueErrors
                assert "NaN" in msgs[1] and "token id" in msgs[0]
            else:
                assert msgs[0] == msgs[1], (name, msgs)
        r = generate(gpu, P, 16, drafter=_oracle(ar, V), tree_budget=8, depth=4)
        np.testing.assert_array_equal(r.tokens, ar.tokens)


def test_device_logits_errors_match_the_host_checks():
    gpu, cfg, V, P, ar = _setup(16)
    cases = []
    x = np.zeros((3, V), np.float32); x[1, V - 1] = np.nan; cases.append(x)
    x = np.zeros((3, V), np.float32); x[2, 7] = np.inf; cases.append(x)
    x = np.zeros((3, V), np.float32); x[1, :] = -np.inf; cases.append(x)
    x = np.zeros((3, V), np.float32); x[0, 5] = np.inf; x[0, 9] = np.nan; cases.append(x)
    for x in cases:
        msgs = []
        for kind in ("numpy", "device"):
            def fn(ctx, depth, top_k, kind=kind, x=x):
                a = x[:min(depth, 3)]
                return a if kind == "numpy" else torch.as_tensor(a, device="cuda")
            with pytest.raises(ValueError) as ei:
                generate(gpu, P, 8, drafter=fn, tree_budget=8, depth=4)
            msgs.append(str(ei.value))
        assert msgs[0] == msgs[1], msgs
    r = generate(gpu, P, 16, drafter=_oracle(ar, V), tree_budget=8, depth=4)
    np.testing.assert_array_equal(r.tokens, ar.tokens)


def test_device_arrays_the_round_cannot_take_in_place():
    """Layouts the GPU round does not read in place go through the host path: a non-contiguous
    tensor is a ValueError naming it, bfloat16 logits a ValueError on the dtype, a draft mixing a
    device and a numpy array is copied (and correct), host rounds copy device arrays."""
    gpu, cfg, V, P, ar = _setup(24)
    orc = _oracle(ar, V)

    def noncontig(ctx, depth, top_k):
        out = orc.draft(ctx, depth, top_k)
        if out is None:
            return None
        lp, ids = out
        t = torch.as_tensor(np.ascontiguousarray(lp.T), device="cuda").T  # a transposed view
        return t, torch.as_tensor(ids.astype(np.int64), device="cuda")

    with pytest.raises(ValueError, match="contiguous"):
        generate(gpu, P, 24, drafter=noncontig, tree_budget=8, depth=4, top_k=4)
    with pytest.raises(ValueError, match="float32"):
        generate(gpu, P, 8, drafter=lambda c, d, k: torch.zeros((d, V), dtype=torch.bfloat16, device="cuda"),
                 tree_budget=8, depth=4)

    orc2 = _oracle(ar, V)

    def mixed(ctx, depth, top_k):
        out = orc2.draft(ctx, depth, top_k)
        if out is None:
            return None
        return torch.as_tensor(out[0], device="cuda"), out[1]

    r = generate(gpu, P, 24, drafter=mixed, tree_budget=8, depth=4, top_k=4)
    np.testing.assert_array_equal(r.tokens, ar.tokens)
    assert r.stats["device_drafts"] == 0
    orc3 = _oracle(ar, V)

    def dev(ctx, depth, top_k):
        out = orc3.draft(ctx, depth, top_k)
        if out is None:
            return None
        return torch.as_tensor(out[0], device="cuda"), torch.as_tensor(out[1], device="cuda")

    r = generate(gpu, P, 24, drafter=dev, tree_budget=8, depth=4, top_k=4, rounds="host")
    np.testing.assert_array_equal(r.tokens, ar.tokens)
    assert r.stats["device_drafts"] == 0 and r.stats["rounds_on"] == "host"


def test_draft_check_kernel_against_numpy():
    """The check kernel's row statistics (_native.cuda_draft_check: each row's first fault code,
    finite count, the ids as int32) against a NumPy definition of the host check, over random
    drafts with planted faults: 1..16 rows, widths across the kernel's 2048-column blocks, int32
    and int64 ids, log-prob and logits drafts."""
    rng = np.random.default_rng(0)
    base = 1 << 30
    V = 50000
    for trial in range(300):
        d = int(rng.integers(1, 17))
        logits = bool(rng.integers(0, 2))
        k = int(rng.choice([7, 4096, 9000, 32000] if logits else [1, 2, 3, 31, 32, 33, 255, 2048, 2049, 5000]))
        x = rng.standard_normal((d, k)).astype(np.float32)
        if not logits:
            x = -np.sort(-x, axis=1)
        ids = rng.integers(0, V, (d, k)).astype(np.int64 if rng.integers(0, 2) else np.int32)
        for _ in range(int(rng.integers(0, 5))):  # planted faults
            r, j, f = int(rng.integers(0, d)), int(rng.integers(0, k)), int(rng.integers(0, 5))
            if f == 0:
                x[r, j] = np.nan
            elif f == 1:
                x[r, j] = np.inf
            elif f == 2:  # -inf: one logit, or a log-prob row's tail (still sorted)
                if logits:
                    x[r, j] = -np.inf
                else:
                    x[r, j:] = -np.inf
            elif f == 3 and not logits:
                ids[r, j] = V + int(rng.integers(0, 3)) if rng.integers(0, 2) else -1
            elif f == 4 and not logits and j > 0:
                x[r, j] = x[r, j - 1] + 1.0
        want_fault = np.zeros(d, np.int64)
        for r in range(d):
            for j in range(k):
                v = x[r, j]
                kind = -1
                if np.isnan(v):
                    kind = 0
                elif v == np.inf:
                    kind = 1
                elif not logits and not (0 <= ids[r, j] < V):
                    kind = 2
                elif not logits and j > 0 and not (x[r, j - 1] >= v):
                    kind = 3
                if kind >= 0:
                    want_fault[r] = base - (j * 4 + kind)
                    break
        fault, fin, ids32 = _native.cuda_draft_check(x, None if logits else ids, V)
        np.testing.assert_array_equal(fault, want_fault, err_msg=f"trial {trial}")
        np.testing.assert_array_equal(fin, np.isfinite(x).sum(axis=1), err_msg=f"trial {trial}")
        if logits:
            assert ids32 is None
        else:
            written = ~np.isnan(x) & (x != np.inf)
            np.testing.assert_array_equal(ids32[written], ids.astype(np.int32)[written])
            assert (ids32[~written] == -7).all()
