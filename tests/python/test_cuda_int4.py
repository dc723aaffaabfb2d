"""INT4 routed experts on the device (ExpertGemmParams::w_int4, Kimi K2-Thinking's W4A16 scheme): both expert
kernels (GEMV-style tiles of 8 slots, tensor-core tiles of 8 / 16 / 32 / 64 slots) reading 4-bit integers
and group scales. The tensor-core kernel must give the bits it gives on the dequantized weights held as BF16
(the loader's values, bf16_round((q - 8) * scale), computed here in NumPy); the GEMV-style kernel sums in its
own lane order (expert_gemv_int4_kernel) and must stay within FP32 rounding of that, and its dequantized
values must be the loader's bit for bit (one-hot inputs give the weights themselves), with BF16 scales
(bf16x2 arithmetic, subnormal products included) and with any float32 scales (the FP32 widening). The FP32
weights are poisoned with NaN so that a read of them shows; every kernel within FP32 rounding of the float64
reference. Shapes with partial column blocks, a k range of one or several groups, several tiles per expert,
group sizes 32 / 64 / 128, rows of 16-weight and 8-weight lanes. Skipped without a usable CUDA device (the
model-level tests are in test_quantized.py)."""
import numpy as np
import pytest

import kdtree_native as kn
from hf_models import to_bf16

if not kn.cuda_available():
    pytest.skip("no usable CUDA device", allow_module_level=True)

from kdtree_native import _native as N  # noqa: E402
from test_cuda_experts import reference, routing  # noqa: E402

pytestmark = pytest.mark.cuda

KERNELS = [("gemv", 8), ("mma", 8), ("mma", 16), ("mma", 32), ("mma", 64)]


def quantized(rng, E, rows, Kd, group, scales="bf16"):
    """(packed uint8 [E, rows, Kd / 2], scales float32 [E, rows, Kd / group], the dequantized float32 weights
    [E, rows, Kd]) with every nibble value and scales of several magnitudes: BF16 values ("bf16"), BF16 values
    whose products are subnormal ("subnormal"), or float32 values that are not BF16 ("float")."""
    packed = rng.integers(0, 256, (E, rows, Kd // 2), dtype=np.uint8)
    raw = (rng.standard_normal((E, rows, Kd // group)) * 0.02
           * np.exp2(rng.integers(-3, 4, (E, rows, Kd // group)))).astype(np.float32)
    if scales == "subnormal":
        raw = (raw * np.float32(2.0 ** -125)).astype(np.float32)  # products of 2^-132 .. : below 2^-126
    scales = raw if scales == "float" else to_bf16(raw)
    q = np.empty((E, rows, Kd), np.int32)
    q[..., 0::2] = packed & 15
    q[..., 1::2] = packed >> 4
    w = to_bf16(((q - 8).astype(np.float32) * np.repeat(scales, group, axis=-1)).astype(np.float32))
    return packed, scales, w


SHAPES = [  # T, K, E, N (outputs), Kd, group
    (1, 8, 64, 64, 256, 32),      # decode: one slot per tile
    (17, 8, 64, 96, 256, 32),     # a B = 16 verify: a partial 64-row block
    (65, 8, 64, 40, 96, 32),      # partial column blocks, a k range of one and a half chunks
    (37, 4, 6, 33, 32, 32),       # one group (half a chunk), odd N, several tiles per expert
    (40, 8, 16, 128, 1024, 128),  # mini-kimi gate/up row length, groups of 128
    (9, 2, 5, 24, 192, 64),       # groups of 64
    (3, 8, 16, 40, 2048, 32),     # the INT4 GEMV's 16-weight lanes, four steps an iteration
    (2, 4, 8, 24, 7168, 128),     # Kimi K2's hidden size: four iterations, the last one half out of range
    (5, 8, 16, 40, 1280, 64),     # 8-weight lanes, four steps an iteration and a partial second one
]


@pytest.mark.parametrize("kernel,tile_rows", KERNELS)
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_int4_experts_equal_their_bf16_values(kernel, tile_rows, swiglu, shape):
    T, K, E, Nout, Kd, group = shape
    rng = np.random.default_rng(T * 1000 + Nout + Kd + group + swiglu)
    x = rng.standard_normal((T, Kd)).astype(np.float32)
    rows = 2 * Nout if swiglu else Nout
    packed, scales, w = quantized(rng, E, rows, Kd, group)
    for skewed in (False, True):
        idx = routing(rng, T, K, E, skewed)
        want, _ = N.cuda_expert_gemm(x, w, idx, E, swiglu, tile_rows, kernel, bf16_weights=True)
        poison = np.full_like(w, np.nan)
        got, slot_token = N.cuda_expert_gemm(x, poison, idx, E, swiglu, tile_rows, kernel, int4_packed=packed,
                                             int4_scales=scales, int4_group=group)
        assert not np.isnan(got).any()
        ref, bound, tok = reference(x, w, idx, swiglu)
        if kernel == "mma":
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        else:  # the INT4 GEMV's own lane order: FP32 rounding apart from the BF16 GEMV
            assert (np.abs(got - want) <= 2e-6 * bound + 1e-30).all()
        assert np.array_equal(slot_token, tok)
        assert (np.abs(got - ref) <= 1e-5 * bound + 1e-30).all()


@pytest.mark.parametrize("scales", ["bf16", "subnormal", "float"])
@pytest.mark.parametrize("Kd,group", [(1024, 32), (512, 128), (256, 32), (96, 32), (1536, 64), (1280, 32), (7168, 128)])
def test_int4_gemv_dequantizes_to_the_loaders_values(scales, Kd, group):
    """The INT4 GEMV's weights are the loader's values bit for bit: with one-hot input rows each output is one
    weight (w * 1 plus exact zeros), for every k of each row, 16-weight lanes (Kd % 512 == 0) and 8-weight lanes,
    BF16 scales (bf16x2 arithmetic; subnormal products too) and float32 scales (the per-weight FP32 path)."""
    rng = np.random.default_rng(Kd + group)
    E, Nout = 3, 40
    packed, sc, w = quantized(rng, E, Nout, Kd, group, scales)
    # token t one-hot at k = ks[t], routed to every expert (K = E): every k up to 1536, else a sample with the ends
    ks = np.arange(Kd) if Kd <= 1536 else np.unique(np.r_[np.arange(64), rng.choice(Kd, 640, replace=False),
                                                          np.arange(Kd - 64, Kd)])
    T = ks.size
    x = np.zeros((T, Kd), np.float32)
    x[np.arange(T), ks] = 1.0
    idx = np.tile(np.arange(E, dtype=np.int32), (T, 1))
    got, slot_token = N.cuda_expert_gemm(x, np.full_like(w, np.nan), idx, E, False, 8, "gemv", int4_packed=packed,
                                         int4_scales=sc, int4_group=group)
    slot_expert = np.sort(idx.reshape(-1), kind="stable")
    want = w[slot_expert, :, ks[slot_token]]  # [A, Nout]: expert e's weight column k = the slot's token's one
    np.testing.assert_array_equal(got, want)
    if scales == "subnormal":
        assert (np.abs(want[want != 0]) < 2.0 ** -126).any()  # the case is there


def test_int4_expert_refusals():
    """Groups the kernels do not take (not a power of two >= 32, not dividing Kd), the tiled SGEMM kernel, and
    mismatched packed / scale shapes: errors, and a good call still works afterwards."""
    rng = np.random.default_rng(5)
    E, Nout, Kd = 4, 16, 64
    x = rng.standard_normal((3, Kd)).astype(np.float32)
    idx = routing(rng, 3, 2, E, False)
    packed, scales, w = quantized(rng, E, Nout, Kd, 32)
    for kernel, rows in KERNELS:
        with pytest.raises(ValueError, match="invalid arguments"):  # groups of 16: not taken on the GPU
            p16, s16, _ = quantized(rng, E, Nout, Kd, 16)
            N.cuda_expert_gemm(x, w, idx, E, False, rows, kernel, int4_packed=p16, int4_scales=s16, int4_group=16)
    with pytest.raises(ValueError, match="invalid arguments"):
        N.cuda_expert_gemm(x, w, idx, E, False, 64, "tiled", int4_packed=packed, int4_scales=scales, int4_group=32)
    with pytest.raises(ValueError, match="int4_packed"):
        N.cuda_expert_gemm(x, w, idx, E, False, 8, "gemv", int4_packed=packed[:, :-1], int4_scales=scales,
                           int4_group=32)
    want, _ = N.cuda_expert_gemm(x, w, idx, E, False, 8, "mma", bf16_weights=True)
    got, _ = N.cuda_expert_gemm(x, w, idx, E, False, 8, "mma", int4_packed=packed, int4_scales=scales, int4_group=32)
    np.testing.assert_array_equal(got, want)
    got, _ = N.cuda_expert_gemm(x, w, idx, E, False, 8, "gemv", int4_packed=packed, int4_scales=scales, int4_group=32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
