"""The grouped expert GEMMs of the MoE layers on the device (cuda::expert_gemm / expert_gemm_mma)
against a float64 NumPy reference: y[slot] = x[token] @ w[expert]^T, or silu(gate) * up with the
gate and up rows of each expert in one matrix. Every kernel (GEMV-style, tiled SGEMM, tensor-core
3xTF32 with tiles of 8, 16, 32 or 64 slots) on shapes with partial column blocks, partial k chunks, several
tiles per expert and skewed routing; the outputs are poisoned (NaN) before each call, so an
unwritten slot fails. Skipped without a usable CUDA device."""
import numpy as np
import pytest

import kdtree_native as kn

if not kn.cuda_available():
    pytest.skip("no usable CUDA device", allow_module_level=True)

from kdtree_native import _native as N  # noqa: E402

pytestmark = pytest.mark.cuda

KERNELS = [("gemv", 8), ("tiled", 64), ("mma", 8), ("mma", 16), ("mma", 32), ("mma", 64)]


def routing(rng, T, K, E, skewed):
    if skewed:  # every token to the same few experts: many tiles per expert
        return np.stack([rng.choice(min(E, max(K, 3)), K, replace=False) for _ in range(T)]).astype(np.int32)
    return np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)


def reference(x, w, idx, swiglu):
    """(y [A, N] float64 by slot, bound [A, N]: FP32 rounding scale of each output)."""
    flat = idx.reshape(-1)
    order = np.argsort(flat, kind="stable")  # slot s holds assignment order[s]
    tok = order // idx.shape[1]
    ex = flat[order]
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    prod = np.zeros((flat.size, w.shape[1]))
    scale = np.zeros_like(prod)
    for e in np.unique(ex):
        s = ex == e
        prod[s] = x64[tok[s]] @ w64[e].T
        scale[s] = np.abs(x64[tok[s]]) @ np.abs(w64[e]).T
    if not swiglu:
        return prod, scale, tok
    n = w.shape[1] // 2
    g, u = prod[:, :n], prod[:, n:]
    sg = g / (1.0 + np.exp(-g))
    # d(silu(g) u) = u silu'(g) dg + silu(g) du, |silu'| <= 1.1
    return sg * u, 1.1 * np.abs(u) * scale[:, :n] + np.abs(sg) * scale[:, n:], tok


SHAPES = [  # T, K, E, N (outputs), Kd
    (1, 8, 64, 64, 256),      # decode: one slot per tile
    (17, 8, 64, 96, 256),     # a B = 16 verify: partial 64-row block (96 = 64 + 32)
    (65, 8, 64, 40, 100),     # partial column blocks, k not a multiple of the 32-float chunk
    (37, 4, 6, 33, 36),       # several tiles per expert, odd N
    (5, 2, 3, 8, 4),          # one k chunk, 4 floats
    (40, 8, 16, 128, 1024),   # mini-kimi gate/up row length
]


@pytest.mark.parametrize("kernel,tile_rows", KERNELS)
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_expert_gemm_matches_float64(kernel, tile_rows, swiglu, shape):
    if kernel == "tiled" and swiglu:
        pytest.skip("the tiled SGEMM writes gate/up; SwiGLU is a separate kernel there")
    T, K, E, Nout, Kd = shape
    rng = np.random.default_rng(hash(shape) % 2**32)
    for skewed in (False, True):
        idx = routing(rng, T, K, E, skewed)
        x = rng.standard_normal((T, Kd)).astype(np.float32)
        # wide dynamic range: a plain TF32 product would miss the 1e-5 bound below
        w = (rng.standard_normal((E, 2 * Nout if swiglu else Nout, Kd)) *
             np.exp(rng.uniform(-3, 3, (E, 1, Kd)))).astype(np.float32)
        y, slot_token = N.cuda_expert_gemm(x, w, idx, E, swiglu, tile_rows, kernel)
        ref, bound, tok = reference(x, w, idx, swiglu)
        assert np.array_equal(slot_token, tok)
        assert y.shape == ref.shape
        assert np.isfinite(y).all(), "an output slot was not written (poisoned NaN left)"
        err = np.abs(y - ref)
        assert (err <= 1e-5 * bound + 1e-30).all(), f"max err / bound {np.max(err / (bound + 1e-30)):.3g}"


@pytest.mark.parametrize("nan_bits", [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000])
@pytest.mark.parametrize("kernel,tile_rows", KERNELS)
def test_expert_nan_weight_propagates(kernel, tile_rows, nan_bits):
    """A NaN in one weight row of one expert gives NaN in that output column of exactly the slots
    routed to that expert, in every kernel (the tensor cores' TF32 rounding must keep CUDA's
    canonical NaN, all mantissa bits set, a NaN)."""
    rng = np.random.default_rng(12)
    T, K, E, Nout, Kd = 33, 8, 64, 64, 256
    idx = routing(rng, T, K, E, False)
    x = rng.standard_normal((T, Kd)).astype(np.float32)
    w = rng.standard_normal((E, Nout, Kd)).astype(np.float32)
    e = int(idx[0, 0])
    w[e, 9, 17] = np.array([nan_bits], np.uint32).view(np.float32)[0]
    y, slot_token = N.cuda_expert_gemm(x, w, idx, E, False, tile_rows, kernel)
    slot_expert = np.sort(idx.reshape(-1), kind="stable")
    hit = slot_expert == e
    assert np.isnan(y[hit, 9]).all() and np.isfinite(y[~hit]).all() and np.isfinite(np.delete(y, 9, axis=1)).all()


@pytest.mark.parametrize("tile_rows", [8, 16, 32, 64])
def test_expert_mma_deterministic_and_close_to_gemv(tile_rows):
    """The same call twice gives the same bits; the tensor-core kernel and the GEMV-style one
    agree within the FP32 rounding bound of the float64 comparison (different summation orders,
    so not bit-equal)."""
    rng = np.random.default_rng(5)
    T, K, E, Nout, Kd = 33, 8, 64, 256, 1024
    idx = routing(rng, T, K, E, False)
    x = rng.standard_normal((T, Kd)).astype(np.float32)
    w = rng.standard_normal((E, 2 * Nout, Kd)).astype(np.float32) * 0.03
    a, _ = N.cuda_expert_gemm(x, w, idx, E, True, tile_rows, "mma")
    b, _ = N.cuda_expert_gemm(x, w, idx, E, True, tile_rows, "mma")
    c, _ = N.cuda_expert_gemm(x, w, idx, E, True, 8, "gemv")
    assert np.array_equal(a, b)
    _, bound, _ = reference(x, w, idx, True)
    assert (np.abs(a - c) <= 2e-5 * bound).all()


def test_expert_gemm_refusals():
    rng = np.random.default_rng(0)
    idx = routing(rng, 4, 2, 8, False)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w = rng.standard_normal((8, 32, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="invalid arguments"):
        N.cuda_expert_gemm(x, w, idx, 8, False, 12, "mma")  # tiles of 12 slots: not one of the kernel's
    with pytest.raises(ValueError, match="invalid arguments"):  # k not a multiple of 4 (no 16-byte copies)
        N.cuda_expert_gemm(x[:, :62].copy(), w[:, :, :62].copy(), idx, 8, False, 8, "mma")
    with pytest.raises(ValueError, match="kernel"):
        N.cuda_expert_gemm(x, w, idx, 8, False, 8, "magic")
    with pytest.raises(ValueError, match="out of range"):
        N.cuda_expert_gemm(x, w, np.full((4, 2), 8, np.int32), 8, False, 8, "mma")
    # still usable after the refusals
    y, _ = N.cuda_expert_gemm(x, w, idx, 8, False, 8, "mma")
    assert np.isfinite(y).all()
