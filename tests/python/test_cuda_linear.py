"""The skinny linear kernel (cuda::linear_skinny, _native.cuda_linear_skinny) and the tiled one
(cuda::linear_tile, kernel="tile") against a float64 NumPy evaluation: every token count 1..32 and some up to 64 (token slices), odd and aligned sizes (scalar and float4 paths),
batched strided layouts (the model's per-head absorbed products), beta 0 (y is not read: it is
poisoned with NaN) and beta 1 (residual add), determinism, and the argument checks.
Skipped without a usable CUDA device."""
import numpy as np
import pytest

import kdtree_native as kn

if not kn.cuda_available():
    pytest.skip("no usable CUDA device", allow_module_level=True)

from kdtree_native import _native as N  # noqa: E402

pytestmark = pytest.mark.cuda


def reference(x, w, y0, T, Nn, Kd, batch, x_batch, w_batch, y_batch, beta, x_off=0, w_off=0):
    """float64 result and the per-element scale sum_k |x w| (the bound's unit)."""
    xf, wf = x.reshape(-1).astype(np.float64), w.reshape(-1).astype(np.float64)
    y = y0.astype(np.float64).copy()
    scale = np.zeros_like(y)
    ldx, ldy = x.shape[1], y0.shape[1]
    for b in range(batch):
        X = np.stack([xf[x_off + b * x_batch + t * ldx: x_off + b * x_batch + t * ldx + Kd] for t in range(T)])
        Wm = wf[w_off + b * w_batch: w_off + b * w_batch + Nn * Kd].reshape(Nn, Kd)
        yv = y.reshape(-1)
        sv = scale.reshape(-1)
        for t in range(T):
            idx = b * y_batch + t * ldy + np.arange(Nn)
            acc = Wm @ X[t]
            yv[idx] = (beta * yv[idx] if beta != 0 else 0) + acc
            sv[idx] = np.abs(Wm) @ np.abs(X[t]) + (abs(beta) * np.abs(y0.reshape(-1)[idx]) if beta != 0 else 0)
    return y, scale


def run_case(rng, T, Nn, Kd, batch=1, beta=0.0, x_pad=0, y_pad=0, interleaved=False, x_off=0, w_off=0, kernel="skinny",
             splits=0, tile_math=0, tile_rows=0):
    if interleaved:  # the model's head layout: x [T, batch * Kd'], head b at columns b * Kd
        ldx, x_batch = batch * Kd + x_pad, Kd
        ldy, y_batch = batch * Nn + y_pad, Nn
        x = rng.standard_normal((T, ldx + x_off)).astype(np.float32)
        y0 = rng.standard_normal((T, ldy)).astype(np.float32)
    else:
        ldx, x_batch = Kd + x_pad, T * (Kd + x_pad)
        ldy, y_batch = Nn + y_pad, T * (Nn + y_pad)
        x = rng.standard_normal((batch * T + (1 if x_off else 0), ldx)).astype(np.float32)
        y0 = rng.standard_normal((batch * T, ldy)).astype(np.float32)
    w_batch = Nn * Kd
    w = rng.standard_normal((1, batch * w_batch + w_off)).astype(np.float32)
    if beta == 0:
        y0[:] = np.nan  # must not be read
    got = N.cuda_linear_skinny(x, w, y0, T, Nn, Kd, batch, x_batch, w_batch, y_batch, beta, x_off, w_off,
                               kernel=kernel, splits=splits, tile_math=tile_math, tile_rows=tile_rows)
    ref, scale = reference(x, w, np.nan_to_num(y0) if beta == 0 else y0, T, Nn, Kd, batch, x_batch, w_batch,
                           y_batch, beta, x_off, w_off)
    # elements the kernel must write: finite and within 1e-5 of the scale; others untouched
    written = scale > 0
    assert np.isfinite(got[written]).all()
    err = np.abs(got.astype(np.float64) - ref)
    assert (err[written] <= 1e-5 * scale[written] + 1e-30).all(), (T, Nn, Kd, batch, float((err / (scale + 1e-30)).max()))
    untouched = ~written
    same = (got[untouched] == y0[untouched]) | (np.isnan(got[untouched]) & np.isnan(y0[untouched]))
    assert same.all()
    return got


@pytest.mark.parametrize("T", list(range(1, 33)) + [40, 47, 48, 63, 64])
def test_every_token_count(T):
    rng = np.random.default_rng(T)
    for Nn, Kd in ((37, 260), (64, 1024), (5, 4), (130, 128)):
        run_case(rng, T, Nn, Kd, beta=0.0)
        run_case(rng, T, Nn, Kd, beta=1.0)


@pytest.mark.parametrize("T", [1, 2, 3, 4, 7, 8, 9, 16, 17, 31, 32])
def test_odd_sizes_and_scalar_path(T):
    rng = np.random.default_rng(100 + T)
    for Nn, Kd in ((1, 1), (3, 5), (17, 131), (33, 1027), (7, 3)):
        run_case(rng, T, Nn, Kd, beta=0.0)
        run_case(rng, T, Nn, Kd, beta=1.0, x_pad=3, y_pad=1)
    # misaligned pointers with aligned sizes: the scalar path too
    run_case(rng, T, 40, 256, x_off=1)
    run_case(rng, T, 40, 256, w_off=2, beta=1.0)


@pytest.mark.parametrize("T", [1, 2, 5, 17, 32, 50])
def test_batched_head_layouts(T):
    rng = np.random.default_rng(200 + T)
    # absorbed W_UK: x = q_nope heads inside [T, H * (Dn + R)], w = W_UK^T [H, C, Dn]
    run_case(rng, T, 64, 16, batch=4, interleaved=True, x_pad=8)
    # W_UV: x = o_lat [T, H * C], w = [H, Dv, C]
    run_case(rng, T, 12, 96, batch=3, interleaved=True)
    run_case(rng, T, 9, 33, batch=5, beta=1.0)


def test_deterministic():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((17, 2048)).astype(np.float32)
    w = rng.standard_normal((1, 300 * 2048)).astype(np.float32)
    y = np.zeros((17, 300), np.float32)
    a = N.cuda_linear_skinny(x, w, y, 17, 300, 2048)
    b = N.cuda_linear_skinny(x, w, y, 17, 300, 2048)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_argument_checks():
    x = np.zeros((70, 8), np.float32)
    w = np.zeros((1, 64), np.float32)
    y = np.zeros((70, 8), np.float32)
    with pytest.raises(ValueError):  # T > kLinearSkinnyMaxT: the launcher refuses (cudaErrorInvalidValue)
        N.cuda_linear_skinny(x, w, y, 65, 8, 8)
    with pytest.raises(ValueError):  # sizes past the arrays: the binding refuses
        N.cuda_linear_skinny(x, w, y, 4, 9, 8)


@pytest.mark.parametrize("T", [1, 2, 3, 4])
@pytest.mark.parametrize("Nn,Kd,x_pad", [(64, 1024, 0), (37, 384, 576), (5, 130, 2), (100, 33, 0)])
def test_fused_rmsnorm_prologue(T, Nn, Kd, x_pad):
    """x rows RMSNorm-ed inside the kernel (norm_w): against the float64 norm then product."""
    rng = np.random.default_rng(T * 7 + Kd)
    x = (rng.standard_normal((T, Kd + x_pad)) * rng.uniform(0.1, 10.0, (T, 1))).astype(np.float32)
    w = rng.standard_normal((1, Nn * Kd)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, Kd).astype(np.float32)
    eps = 1e-6
    y0 = np.full((T, Nn), np.nan, np.float32)
    got = N.cuda_linear_skinny(x, w, y0, T, Nn, Kd, norm_w=g, norm_eps=eps)
    xd = x[:, :Kd].astype(np.float64)
    xn = g * xd / np.sqrt((xd ** 2).mean(axis=1, keepdims=True) + eps)
    Wm = w.reshape(Nn, Kd).astype(np.float64)
    ref = xn @ Wm.T
    scale = np.abs(xn) @ np.abs(Wm).T
    assert np.isfinite(got).all()
    assert (np.abs(got - ref) <= 1e-5 * scale + 1e-30).all()


@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("Nn,Kd", [(576, 1024), (64, 1024), (5, 130), (100, 33)])
def test_fused_rmsnorm_writes_normalised_rows(T, Nn, Kd):
    """norm_out: the normalised rows (what the model's routed experts read after the merged
    router / shared gate-up projection), every element written, within 1e-6 of float64, and the
    product the same as without norm_out."""
    rng = np.random.default_rng(T * 13 + Kd)
    x = (rng.standard_normal((T, Kd)) * rng.uniform(0.1, 10.0, (T, 1))).astype(np.float32)
    w = rng.standard_normal((1, Nn * Kd)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, Kd).astype(np.float32)
    y0 = np.full((T, Nn), np.nan, np.float32)
    got, normed = N.cuda_linear_skinny(x, w, y0, T, Nn, Kd, norm_w=g, norm_eps=1e-6, norm_out=True)
    xd = x.astype(np.float64)
    xn = g * xd / np.sqrt((xd ** 2).mean(axis=1, keepdims=True) + 1e-6)
    assert normed.shape == (T, Kd) and np.isfinite(normed).all()
    assert (np.abs(normed - xn) <= 1e-6 * np.abs(xn) + 1e-30).all()
    plain = N.cuda_linear_skinny(x, w, y0, T, Nn, Kd, norm_w=g, norm_eps=1e-6)
    assert np.array_equal(got, plain)


def test_fused_rmsnorm_only_for_few_tokens():
    x = np.ones((5, 8), np.float32)
    w = np.ones((1, 64), np.float32)
    y = np.zeros((5, 8), np.float32)
    with pytest.raises(ValueError):
        N.cuda_linear_skinny(x, w, y, 5, 8, 8, norm_w=np.ones(8, np.float32))
    with pytest.raises(ValueError):  # norm_out needs the fused norm
        N.cuda_linear_skinny(x, w, y, 2, 8, 8, norm_out=True)


@pytest.mark.parametrize("T", [1, 2, 4, 7, 16, 17, 33])
@pytest.mark.parametrize("Nn,Kd,x_pad", [(1024, 256, 0), (64, 2816, 0), (37, 20, 3), (100, 33, 0)])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_swiglu_input(T, Nn, Kd, x_pad, beta):
    """x rows [gate | up] (x_swiglu): the product uses silu(gate) * up, as the model's MLP down
    projections (dense layers, shared experts); against the float64 SwiGLU then product."""
    rng = np.random.default_rng(T * 11 + Kd + int(beta))
    x = (rng.standard_normal((T, 2 * Kd + x_pad)) * 3.0).astype(np.float32)
    w = rng.standard_normal((1, Nn * Kd)).astype(np.float32)
    y0 = rng.standard_normal((T, Nn)).astype(np.float32)
    if beta == 0:
        y0[:] = np.nan  # must not be read
    got = N.cuda_linear_skinny(x, w, y0, T, Nn, Kd, beta=beta, x_swiglu=True)
    g, u = x[:, :Kd].astype(np.float64), x[:, Kd:2 * Kd].astype(np.float64)
    xs = g / (1.0 + np.exp(-g)) * u
    Wm = w.reshape(Nn, Kd).astype(np.float64)
    base = y0.astype(np.float64) if beta else 0.0
    ref = base + xs @ Wm.T
    scale = np.abs(xs) @ np.abs(Wm).T + (np.abs(y0) if beta else 0.0)
    assert np.isfinite(got).all()
    assert (np.abs(got - ref) <= 2e-5 * scale + 1e-30).all(), float((np.abs(got - ref) / scale).max())


def test_swiglu_input_argument_checks():
    x = np.ones((2, 16), np.float32)
    w = np.ones((1, 64), np.float32)
    y = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError):  # a row must hold 2 Kd floats
        N.cuda_linear_skinny(x, w, y, 2, 8, 9, x_swiglu=True)
    with pytest.raises(ValueError):  # not together with the fused RMSNorm
        N.cuda_linear_skinny(x, w, y, 2, 8, 8, x_swiglu=True, norm_w=np.ones(8, np.float32))


CONFIGS = list(range(1, len(N.cuda_linear_skinny_configs()) + 1))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("T", [1, 3, 9, 17, 40])
def test_every_forced_configuration(config, T):
    """Each configuration of the table (forced: config=i+1) on any token count (slices of its
    token capacity), odd and aligned sizes, batched heads, beta 0 / 1: against float64."""
    rng = np.random.default_rng(1000 * config + T)
    for Nn, Kd in ((37, 260), (130, 128), (17, 131), (5, 4)):
        for beta in (0.0, 1.0):
            x = rng.standard_normal((T, Kd)).astype(np.float32)
            w = rng.standard_normal((1, Nn * Kd)).astype(np.float32)
            y0 = rng.standard_normal((T, Nn)).astype(np.float32)
            if beta == 0:
                y0[:] = np.nan
            got = N.cuda_linear_skinny(x, w, y0, T, Nn, Kd, beta=beta, config=config)
            Wm = w.reshape(Nn, Kd).astype(np.float64)
            ref = (y0.astype(np.float64) if beta else 0.0) + x.astype(np.float64) @ Wm.T
            scale = np.abs(x.astype(np.float64)) @ np.abs(Wm).T + (np.abs(y0) if beta else 0.0)
            assert np.isfinite(got).all()
            assert (np.abs(got - ref) <= 1e-5 * scale + 1e-30).all(), (Nn, Kd, beta)
    # batched head layout (W_UK-like)
    x = rng.standard_normal((T, 4 * 40)).astype(np.float32)
    w = rng.standard_normal((1, 4 * 24 * 36)).astype(np.float32)
    y0 = np.full((T, 4 * 24), np.nan, np.float32)
    got = N.cuda_linear_skinny(x, w, y0, T, 24, 36, 4, 40, 24 * 36, 24, config=config)
    for b in range(4):
        Wm = w.reshape(4, 24, 36)[b].astype(np.float64)
        X = x[:, b * 40: b * 40 + 36].astype(np.float64)
        ref = X @ Wm.T
        assert (np.abs(got[:, b * 24:(b + 1) * 24] - ref) <= 1e-5 * (np.abs(X) @ np.abs(Wm).T) + 1e-30).all()


def rope_reference(x, cs, T, H, ldh, off, R, interleaved):
    """float32 RoPE as mla_prep / the CPU apply it (each product and sum rounded once):
    out[t, h] = (a c - b s, b c + a s) over the pairs (a, b) of head h's rope part."""
    half = R // 2
    out = np.empty((T, H * R), np.float32)
    for t in range(T):
        c, s = cs[t, :half], cs[t, half:]
        for h in range(H):
            seg = x[t, h * ldh + off: h * ldh + off + R]
            a, b = (seg[0::2], seg[1::2]) if interleaved else (seg[:half], seg[half:])
            out[t, h * R: h * R + half] = a * c - b * s
            out[t, h * R + half: (h + 1) * R] = b * c + a * s
    return out


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 17, 40])
@pytest.mark.parametrize("Dn,R,H", [(128, 64, 16), (64, 8, 3)])
@pytest.mark.parametrize("interleaved", [0, 1])
def test_rope_block(T, Dn, R, H, interleaved):
    """The W_UK product's rope block (LinearParams::rope_out): the heads' rope parts roped bit for
    bit as NumPy's float32 (mla_prep's arithmetic), every output written (poisoned with NaN), and
    the product itself unchanged (the same bits as without the block)."""
    rng = np.random.default_rng(100 * T + R + interleaved)
    C, ldh = 48, Dn + R
    x = rng.standard_normal((T, H * ldh)).astype(np.float32)
    w = rng.standard_normal((1, H * C * Dn)).astype(np.float32)
    cs = rng.standard_normal((T, R)).astype(np.float32)
    y0 = np.full((T, H * C), np.nan, np.float32)
    args = (x, w, y0, T, C, Dn, H, ldh, C * Dn, C)
    plain = N.cuda_linear_skinny(*args)
    y, q = N.cuda_linear_skinny(*args, rope_cs=cs, rope_off=Dn, rope_interleaved=interleaved)
    assert np.array_equal(y.view(np.int32), plain.view(np.int32))
    ref = rope_reference(x, cs, T, H, ldh, Dn, R, interleaved)
    assert np.array_equal(q.view(np.int32), ref.view(np.int32))


def prep_reference(kv, g, cs, eps, interleaved, qa, qa_eps):
    """mla_prep's cache rows in NumPy: [g * (x * inv) | rope(k_rope)] with inv = 1 / sqrt(float32(mean of the
    squares, summed in float64) + eps) rounded to float32, each product rounded once; 1 / rms of the qa rows."""
    C, R = g.shape[0], cs.shape[1]
    lat = kv[:, :C]
    var = ((lat.astype(np.float64) ** 2).sum(axis=1) / C).astype(np.float32)
    inv = (1.0 / np.sqrt(var.astype(np.float64) + eps)).astype(np.float32)
    rows = np.empty((kv.shape[0], C + R), np.float32)
    rows[:, :C] = g * (lat * inv[:, None])
    rows[:, C:] = rope_reference(kv[:, C:C + R], cs, kv.shape[0], 1, R, 0, R, interleaved)
    scale = None
    if qa is not None:
        qv = ((qa.astype(np.float64) ** 2).sum(axis=1) / qa.shape[1]).astype(np.float32)
        scale = (1.0 / np.sqrt(qv.astype(np.float64) + qa_eps)).astype(np.float32)
    return rows, scale


@pytest.mark.parametrize("T,H", [(1, 16), (2, 16), (5, 16), (17, 16), (20, 16), (40, 16), (9, 3), (17, 1)])
@pytest.mark.parametrize("C,R,folded", [(512, 64, True), (512, 64, False), (96, 8, True), (1100, 16, True)])
def test_prep_blocks_equal_mla_prep(T, H, C, R, folded):
    """The W_UK launch's prep blocks (LinearParams::prep_on: mla_prep's cache rows and the folded query norm's
    factor inside the rope blocks, block y of each token slice taking tokens y, y + H, ...) write the same bits
    as the mla_prep kernel, every row and factor written (the cache is NaN-poisoned), both as the NumPy
    reference; C = 96 (a 128-thread mla_prep block), 1100 (elements past the ones loaded up front)."""
    rng = np.random.default_rng(1000 * T + C + H)
    kv = (rng.standard_normal((T, C + R + 3)) * rng.uniform(0.1, 4.0, (T, 1))).astype(np.float32)
    g = rng.uniform(0.5, 1.5, C).astype(np.float32)
    cs = rng.standard_normal((T, R)).astype(np.float32)
    qa = (rng.standard_normal((T, 384)) * 3).astype(np.float32) if folded else None
    for il in (0, 1):
        k_rows, k_sc = N.cuda_mla_prep_rows(kv, g, cs, 1e-6, il, qa, 1e-6, H=H, via="kernel", row0=5)
        u_rows, u_sc = N.cuda_mla_prep_rows(kv, g, cs, 1e-6, il, qa, 1e-6, H=H, via="uk", row0=5)
        assert np.array_equal(k_rows.view(np.int32), u_rows.view(np.int32))
        ref_rows, ref_sc = prep_reference(kv, g, cs, 1e-6, il, qa, 1e-6)
        assert not np.isnan(u_rows).any()
        assert (np.abs(u_rows - ref_rows) <= 2e-7 * np.abs(ref_rows) + 1e-30).all()
        if folded:
            assert np.array_equal(k_sc.view(np.int32), u_sc.view(np.int32))
            assert (np.abs(u_sc - ref_sc) <= 2e-7 * ref_sc).all()
        else:
            assert k_sc is None and u_sc is None


def test_rope_block_refusals():
    """The rope block exists for the W_UK product's configurations only: others, an odd rope width,
    a rope part past the row and the prologues are refused (ValueError), not ignored."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 4 * 72)).astype(np.float32)
    w = rng.standard_normal((1, 4 * 48 * 64)).astype(np.float32)
    y = np.zeros((2, 4 * 48), np.float32)
    cs = rng.standard_normal((2, 8)).astype(np.float32)
    args = (x, w, y, 2, 48, 64, 4, 72, 48 * 64, 48)
    N.cuda_linear_skinny(*args, rope_cs=cs, rope_off=64)  # auto: a configuration with the block
    configs = N.cuda_linear_skinny_configs()
    other = next(i + 1 for i, c in enumerate(configs) if tuple(c) not in ((4, 1, 1), (8, 4, 1)))
    with pytest.raises(ValueError):
        N.cuda_linear_skinny(*args, rope_cs=cs, rope_off=64, config=other)
    with pytest.raises(ValueError):  # odd width
        N.cuda_linear_skinny(*args, rope_cs=cs[:, :7].copy(), rope_off=64)
    with pytest.raises(ValueError):  # past the arrays
        N.cuda_linear_skinny(*args, rope_cs=cs, rope_off=4 * 72)
    with pytest.raises(ValueError):  # head rows of 34 floats: the scalar path has no rope block
        xs = rng.standard_normal((2, 5 * 34)).astype(np.float32)
        ws = rng.standard_normal((1, 5 * 48 * 32)).astype(np.float32)
        N.cuda_linear_skinny(xs, ws, np.zeros((2, 5 * 48), np.float32), 2, 48, 32, 5, 34, 48 * 32, 48,
                             rope_cs=cs[:, :2].copy(), rope_off=32)
    with pytest.raises(ValueError):  # not with the RMSNorm prologue
        N.cuda_linear_skinny(x[:, :64].copy(), w[:, :48 * 64].copy(), np.zeros((2, 48), np.float32), 2, 48, 64,
                             norm_w=np.ones(64, np.float32), rope_cs=cs, rope_off=0)


@pytest.mark.parametrize("config", CONFIGS)
def test_forced_configuration_prologues(config):
    """The RMSNorm prologue (and its normalised rows) with every configuration that holds <= 4
    tokens per slice (others refuse it: ValueError), the SwiGLU prologue with all."""
    rng = np.random.default_rng(config)
    RW, TT, U = N.cuda_linear_skinny_configs()[config - 1]
    T, Nn, Kd = 4, 70, 384
    x = (rng.standard_normal((T, 2 * Kd)) * 2).astype(np.float32)
    w = rng.standard_normal((1, Nn * Kd)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, Kd).astype(np.float32)
    y0 = np.full((T, Nn), np.nan, np.float32)
    Wm = w.reshape(Nn, Kd).astype(np.float64)
    if TT <= 4:
        got, normed = N.cuda_linear_skinny(x, w, y0, T, Nn, Kd, norm_w=g, norm_eps=1e-6, norm_out=True, config=config)
        xd = x[:, :Kd].astype(np.float64)
        xn = g * xd / np.sqrt((xd ** 2).mean(axis=1, keepdims=True) + 1e-6)
        assert (np.abs(normed - xn) <= 1e-6 * np.abs(xn) + 1e-30).all()
        assert (np.abs(got - xn @ Wm.T) <= 1e-5 * (np.abs(xn) @ np.abs(Wm).T) + 1e-30).all()
    else:
        with pytest.raises(ValueError):
            N.cuda_linear_skinny(x, w, y0, T, Nn, Kd, norm_w=g, config=config)
    got = N.cuda_linear_skinny(x, w, y0, T, Nn, Kd, x_swiglu=True, config=config)
    gg, u = x[:, :Kd].astype(np.float64), x[:, Kd:].astype(np.float64)
    xs = gg / (1.0 + np.exp(-gg)) * u
    assert (np.abs(got - xs @ Wm.T) <= 2e-5 * (np.abs(xs) @ np.abs(Wm).T) + 1e-30).all()
    with pytest.raises(ValueError):
        N.cuda_linear_skinny(x, w, y0, T, Nn, Kd, config=len(CONFIGS) + 1)


# ---------------------------------------------------------------- linear_tile
TILE_T = list(range(1, 10)) + [15, 16, 17, 23, 24, 25, 31, 32, 33, 41, 48, 49, 63, 64, 65, 71, 72, 73, 100, 129, 257]


@pytest.mark.parametrize("tile_math", [0, 1])
@pytest.mark.parametrize("T", TILE_T)
def test_tile_every_token_count(T, tile_math):
    """linear_tile (tensor cores 3xTF32 and FP32 CUDA cores) at token counts around its automatic
    tile heights (for these small matrices: 8 rows up to 8 tokens, 16-row tiles up to 32, 24-row
    tiles past that; test_tile_forced_tile_rows takes every height), column
    counts around its 64-row tiles, k lengths around its 64-float chunks and the auto split count (a cluster of k splits): beta 0
    (y poisoned, must not be read) and 1; within 1e-5 of sum |x w| of the float64 result."""
    rng = np.random.default_rng(5000 + T)
    for Nn, Kd in ((64, 1024), (37, 260), (130, 128), (5, 4), (200, 36), (1, 2048)):
        run_case(rng, T, Nn, Kd, beta=0.0, kernel="tile", tile_math=tile_math)
        run_case(rng, T, Nn, Kd, beta=1.0, x_pad=4, y_pad=3, kernel="tile", tile_math=tile_math)


@pytest.mark.parametrize("tile_math", [0, 1])
@pytest.mark.parametrize("rows", [8, 16, 24, 32, 48, 64, 72])
def test_tile_forced_tile_rows(rows, tile_math):
    """Every tile height forced (LinearParams::tile_rows) at token counts below, at and past it (one
    partial tile, several tiles, a last tile of one token), with k splits and batched heads: against
    float64; heights the kernel does not have are refused."""
    rng = np.random.default_rng(7000 + rows)
    for T in sorted({1, rows - 1, rows, rows + 1, 2 * rows + 3}):
        if T < 1:
            continue
        run_case(rng, T, 100, 320, beta=0.0, kernel="tile", tile_math=tile_math, tile_rows=rows)
        run_case(rng, T, 64, 1024, beta=1.0, x_pad=4, y_pad=3, kernel="tile", splits=3, tile_math=tile_math,
                 tile_rows=rows)
        run_case(rng, T, 64, 128, batch=4, interleaved=True, x_pad=8, kernel="tile", tile_math=tile_math,
                 tile_rows=rows)
    x = np.ones((4, 64), np.float32)
    w = np.ones((8, 64), np.float32)
    y = np.zeros((4, 8), np.float32)
    for bad in (7, 40, 80, -8):
        with pytest.raises(ValueError, match="invalid arguments"):
            N.cuda_linear_skinny(x, w, y, 4, 8, 64, kernel="tile", tile_rows=bad)


@pytest.mark.parametrize("splits", list(range(1, 9)))
@pytest.mark.parametrize("T", [3, 17, 40, 70])
def test_tile_forced_splits(splits, T):
    """Every k split count of the cluster reduction (1..8; more splits than k chunks fold to
    fewer), both maths: against float64, y poisoned outside the product, beta 0 and 1, batched
    heads."""
    rng = np.random.default_rng(100 * splits + T)
    for tile_math in (0, 1):
        for Nn, Kd in ((96, 1024), (64, 100), (33, 2048), (70, 32)):
            run_case(rng, T, Nn, Kd, beta=0.0, kernel="tile", splits=splits, tile_math=tile_math)
            run_case(rng, T, Nn, Kd, beta=1.0, kernel="tile", splits=splits, tile_math=tile_math)
        run_case(rng, T, 64, 128, batch=4, interleaved=True, x_pad=8, kernel="tile", splits=splits, tile_math=tile_math)


@pytest.mark.parametrize("tile_math", [0, 1])
@pytest.mark.parametrize("T", [1, 5, 17, 32, 50, 65])
def test_tile_batched_head_layouts(T, tile_math):
    rng = np.random.default_rng(6000 + T)
    # absorbed W_UK: x = q_nope heads inside [T, H * (Dn + R)], w = W_UK^T [H, C, Dn]
    run_case(rng, T, 64, 16, batch=4, interleaved=True, x_pad=8, kernel="tile", tile_math=tile_math)
    # W_UV: x = o_lat [T, H * C], w = [H, Dv, C]
    run_case(rng, T, 12, 96, batch=3, interleaved=True, kernel="tile", tile_math=tile_math)
    run_case(rng, T, 9, 36, batch=5, beta=1.0, kernel="tile", tile_math=tile_math)


@pytest.mark.parametrize("tile_math", [0, 1])
def test_tile_deterministic_and_equal_across_calls(tile_math):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((33, 2048)).astype(np.float32)
    w = rng.standard_normal((1, 300 * 2048)).astype(np.float32)
    y = np.zeros((33, 300), np.float32)
    a = N.cuda_linear_skinny(x, w, y, 33, 300, 2048, kernel="tile", tile_math=tile_math)
    b = N.cuda_linear_skinny(x, w, y, 33, 300, 2048, kernel="tile", tile_math=tile_math)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_tile_tensor_cores_are_fp32_accurate():
    """The 3xTF32 split is FP32-accurate, not TF32: on wide-range values (a TF32 product alone
    would be off by ~1e-4 of sum |x w| here) the error stays within 5e-6 of sum |x w|, the same
    bound the CUDA-core path meets."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((17, 1024)) * np.exp(rng.uniform(-3, 3, (17, 1024)))).astype(np.float32)
    w = (rng.standard_normal((1, 96 * 1024)) * np.exp(rng.uniform(-3, 3, (1, 96 * 1024)))).astype(np.float32)
    y = np.zeros((17, 96), np.float32)
    wm = w.reshape(96, 1024).astype(np.float64)
    ref, scale = x.astype(np.float64) @ wm.T, np.abs(x.astype(np.float64)) @ np.abs(wm).T
    for tile_math in (0, 1):
        got = N.cuda_linear_skinny(x, w, y, 17, 96, 1024, kernel="tile", tile_math=tile_math)
        assert (np.abs(got - ref) <= 5e-6 * scale).all(), (tile_math, float((np.abs(got - ref) / scale).max()))


@pytest.mark.parametrize("nan_bits", [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000])
def test_tile_nan_weight_propagates(nan_bits):
    """A NaN weight gives a NaN in its output column and nowhere else, on the tensor cores too
    (their TF32 rounding must not turn CUDA's canonical NaN, all mantissa bits set, into 0)."""
    rng = np.random.default_rng(10)
    x = rng.standard_normal((17, 256)).astype(np.float32)
    w = rng.standard_normal((1, 40 * 256)).astype(np.float32)
    w[0, 7 * 256 + 100] = np.array([nan_bits], np.uint32).view(np.float32)[0]
    y = np.zeros((17, 40), np.float32)
    for tile_math in (0, 1):
        got = N.cuda_linear_skinny(x, w, y, 17, 40, 256, kernel="tile", tile_math=tile_math)
        assert np.isnan(got[:, 7]).all(), (tile_math, hex(nan_bits))
        assert np.isfinite(np.delete(got, 7, axis=1)).all(), (tile_math, hex(nan_bits))


def test_tile_refuses_what_it_cannot_take():
    """Unaligned rows or pointers, the prologues, a split count past 8 and an unknown kernel name
    are refused (ValueError), not computed wrongly."""
    x = np.ones((8, 16), np.float32)
    w = np.ones((1, 16 * 16), np.float32)
    y = np.zeros((8, 16), np.float32)
    assert np.allclose(N.cuda_linear_skinny(x, w, y, 8, 16, 16, kernel="tile"), 16.0)
    for kw in (dict(Kd=15), dict(x_off=1), dict(w_off=2), dict(splits=9), dict(splits=-1), dict(tile_math=2)):
        args = dict(Kd=16, x_off=0, w_off=0, splits=0, tile_math=0)
        args.update(kw)
        with pytest.raises(ValueError):
            N.cuda_linear_skinny(x, w, y, 4, 8, args["Kd"], x_off=args["x_off"], w_off=args["w_off"], kernel="tile",
                                 splits=args["splits"], tile_math=args["tile_math"])
    with pytest.raises(ValueError):
        N.cuda_linear_skinny(x, w, y, 4, 8, 16, norm_w=np.ones(16, np.float32), kernel="tile")
    with pytest.raises(ValueError):
        N.cuda_linear_skinny(x, w, y, 4, 8, 8, x_swiglu=True, kernel="tile")
    with pytest.raises(ValueError):
        N.cuda_linear_skinny(x, w, y, 4, 8, 16, kernel="flash")


@pytest.mark.parametrize("T", [5, 6, 9, 16, 17, 24, 25, 32])
def test_tile_large_matrix_more_warps_per_row_group(T):
    """A matrix past kLinearTileSmallBytes (32 MiB as FP32: the head's case) runs two or four warps per row
    group, each on its own part of every k-chunk (KH, linear_tile.cu): every tile height it takes, the
    automatic and forced k splits, beta = 1 with padded rows and a partial last weight tile; and one of >= 64 MiB
    (the split rule's own case for the head)."""
    rng = np.random.default_rng(700 + T)
    run_case(rng, T, 8200, 1024, beta=0.0, kernel="tile")
    run_case(rng, T, 16400, 1024, beta=0.0, kernel="tile")
    run_case(rng, T, 8257, 1028, beta=1.0, x_pad=4, y_pad=3, kernel="tile")
    run_case(rng, T, 8200, 1024, beta=0.0, kernel="tile", splits=3)
