"""The Mosaic GPU grouped GEMM kernels in GPU interpret mode (bf16 operands, fp32 reference on
the same values): the row-tile work table, forward / dx / dW against the reference, the extra
contraction, chained work items, and race detection over every launch shape."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _hopper
from pallas_kernels.moe import mosaic_gpu, mosaic_tgmm
from pallas_kernels.moe.reference import (grouped_matmul_reference,
                                          grouped_matmul_transposed_reference)

sys.path.insert(0, str(Path(__file__).parent))
from moe_common import group_sizes_of, operands, rel_err  # noqa: E402


# configs: the default (columns split between warpgroups; dx with rows split,
# TRANSPOSED_CONFIG) and the forward with rows split between warpgroups (half-tile wgmma
# skipping; its fused SwiGLU interleaves in blocks of 128), and 32-wide k steps (A's 64-byte
# swizzle sets B's); "tail" has m = 379 (not a multiple of 8: padded inside gmm)
M_CONFIG = mosaic_gpu.TileConfig(wg_split="m")
TK32_CONFIG = mosaic_gpu.TileConfig(tile_k=32)


def test_row_tile_table_covers_every_row_once():
    m, tm, e = 1000, 128, 16
    for kind in ("zipf", "one", "tail", "uniform"):
        gs = group_sizes_of(kind, m, e, seed=5)
        table = np.asarray(mosaic_gpu.row_tile_table(gs, m, tm))
        owner = np.full(m, -1)
        for g, row0, lo, hi in table.T:
            if hi == lo:
                continue
            assert row0 % 8 == 0 and 0 <= lo < hi <= tm and row0 + tm <= m
            rows = np.arange(row0 + lo, row0 + hi)
            assert np.all(owner[rows] == -1)
            owner[rows] = g
        ends = np.cumsum(np.asarray(gs))
        np.testing.assert_array_equal(owner, np.searchsorted(ends, np.arange(m), side="right"))
        # a group of s rows takes at most cdiv(s + 7, tm) tiles
        sizes = np.append(np.asarray(gs), m - np.asarray(gs).sum())
        used = np.bincount(table[0][table[3] > table[2]], minlength=e + 1)
        assert np.all(used <= -(-(sizes + 7) // tm))


@pytest.mark.parametrize("kind,e,config", [("zipf", 8, None), ("one", 4, None), ("tail", 6, None),
                                           ("zipf", 5, M_CONFIG), ("tail", 5, TK32_CONFIG)])
def test_mosaic_gmm_forward_and_kernels(kind, e, config):
    m, kd, n = (379 if kind == "tail" else 384), 128, 256
    x, w, dy = operands(m, kd, n, e, seed=e)
    gs = group_sizes_of(kind, m, e, seed=e)
    f32 = lambda a: a.astype(jnp.float32)

    out = mosaic_gpu.gmm(x, w, gs, out_dtype=jnp.float32, config=config)
    ref = grouped_matmul_reference(f32(x), f32(w), gs)
    assert out.shape == (m, n)
    assert rel_err(out, ref) < 1e-5
    if kind == "tail":
        assert np.all(np.asarray(out)[int(gs.sum()):] == 0)
    if config is M_CONFIG:  # its fused SwiGLU epilogue (interleave block 128), forward only
        w_il = mosaic_gpu.interleave_gate_up(w, block=mosaic_gpu.swiglu_block(config))
        act = mosaic_gpu.gmm(x, w_il, gs, epilogue="swiglu", config=config)
        gate, up = mosaic_gpu.deinterleave_gate_up(
            grouped_matmul_reference(f32(x), f32(w_il), gs), block=128)
        assert act.shape == (m, n // 2) and rel_err(act, jax.nn.silu(gate) * up) < 1e-2
    if config is not None:
        return  # the dx / dw kernels below do not depend on these options

    dx = mosaic_gpu.gmm(dy, w, gs, transpose_rhs=True, out_dtype=jnp.float32)
    dx_ref = grouped_matmul_reference(f32(dy), jnp.swapaxes(f32(w), 1, 2), gs)
    assert rel_err(dx, dx_ref) < 1e-5

    dw = mosaic_tgmm.tgmm(x, dy, gs, out_dtype=jnp.float32)
    dw_ref = grouped_matmul_transposed_reference(f32(x), f32(dy), gs)
    assert rel_err(dw, dw_ref) < 1e-5
    empty = np.asarray(gs) == 0
    assert np.all(np.asarray(dw)[empty] == 0)


@pytest.mark.parametrize("kind,out_dtype,in_place", [("tail", jnp.bfloat16, True), ("zipf", jnp.float32, True),
                                                     ("tail", jnp.bfloat16, False)])
def test_tgmm_sums_of_squares(kind, out_dtype, in_place):
    """tgmm(sq_out=...): per row of dw and column tile, the sum of squares of dw as stored
    (rounded to out_dtype), at rows out_row .. out_row + E of the ref (rows outside untouched);
    with out= into a stacked gradient or alone; bf16 (128-column tiles) and fp32 (64) outputs;
    379 rows with an empty group. Against the squares of the returned dw."""
    m, kd, n, e, row = (379 if kind == "tail" else 384), 128, 256, 5, 3
    x, _, dy = operands(m, kd, n, e, seed=11)
    gs = group_sizes_of(kind, m, e, seed=11)
    tn = mosaic_tgmm.sq_tile_n(kd, n, out_dtype)
    assert tn == (64 if out_dtype == jnp.float32 else 128)
    g_rows = row + e + 2

    @jax.jit
    def run(x, dy, gs):
        sq = jax.new_ref(jnp.full((g_rows, n // tn, kd), -1.0, jnp.float32))
        if in_place:
            out = jax.new_ref(jnp.zeros((g_rows, kd, n), out_dtype))
            mosaic_tgmm.tgmm(x, dy, gs, out=out, out_row=row, sq_out=sq)
            return out[...][row:row + e], sq[...]
        return mosaic_tgmm.tgmm(x, dy, gs, out_dtype=out_dtype, sq_out=sq), sq[...]

    dw, sq = run(x, dy, gs)
    at = row if in_place else 0
    want = jnp.square(dw.astype(jnp.float32)).reshape(e, kd, n // tn, tn).sum(-1).transpose(0, 2, 1)
    assert float(jnp.min(want[np.asarray(gs) > 0])) > 0
    assert rel_err(sq[at:at + e], want) < 1e-6
    np.testing.assert_allclose(float(jnp.sum(sq[at:at + e])), float(jnp.sum(jnp.square(dw.astype(jnp.float32)))),
                               rtol=1e-6)
    assert np.all(np.asarray(sq[at:at + e])[np.asarray(gs) == 0] == 0)
    outside = np.delete(np.asarray(sq), np.arange(at, at + e), axis=0)
    assert np.all(outside == -1.0)
    with pytest.raises(ValueError, match="sq_out"):
        mosaic_tgmm.tgmm(x, dy, gs, out_dtype=out_dtype, sq_out=jnp.zeros((e, n // tn + 1, kd), jnp.float32))


@pytest.mark.parametrize("kind,config,transpose,r", [
    ("zipf", None, False, 64), ("tail", None, False, 64), ("zipf", M_CONFIG, False, 64), ("one", None, True, 64),
    ("zipf", None, False, 16), ("tail", M_CONFIG, False, 32), ("zipf", None, True, 16), ("one", None, True, 32)])
def test_mosaic_gmm_extra_contraction(kind, config, transpose, r):
    """gmm(extra=(t, b)): x @ w[g] + t @ b[g] in one accumulator (b^T with transposed weights),
    both warpgroup splits, 379 rows (padded inside), an empty group; extra widths 64 and the
    narrow 16 and 32 (one wgmma k step or two, B's swizzle set by t's)."""
    m, kd, n, e = (379 if kind == "tail" else 384), 128, 256, 5
    k = jax.random.split(jax.random.key(e), 4)
    x = jax.random.normal(k[0], (m, kd)).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (e, n, kd) if transpose else (e, kd, n)) / 8).astype(jnp.bfloat16)
    t = jax.random.normal(k[2], (m, r)).astype(jnp.bfloat16)
    b = (jax.random.normal(k[3], (e, n, r) if transpose else (e, r, n)) / 8).astype(jnp.bfloat16)
    gs = group_sizes_of(kind, m, e, seed=e)
    f32 = lambda a: a.astype(jnp.float32)
    orient = (lambda a: jnp.swapaxes(f32(a), 1, 2)) if transpose else f32
    out = mosaic_gpu.gmm(x, w, gs, transpose_rhs=transpose, out_dtype=jnp.float32, config=config,
                         extra=(t, b))
    ref = grouped_matmul_reference(f32(x), orient(w), gs) + grouped_matmul_reference(f32(t), orient(b), gs)
    assert out.shape == (m, n) and rel_err(out, ref) < 1e-5
    if kind == "tail":
        assert np.all(np.asarray(out)[int(gs.sum()):] == 0)
    with pytest.raises(ValueError, match="extra"):  # a width that is no multiple of 16
        mosaic_gpu.gmm(x, w, gs, transpose_rhs=transpose,
                       extra=(t[:, :r - 8], b[..., :r - 8] if transpose else b[:, :r - 8]))


def _tgmm_with_squares(tgmm, x, dy, gs):
    """tgmm writing dw in place into a ref of two layers (at layer 1) and its squares."""
    e, (kd, n) = gs.shape[0], (x.shape[1], dy.shape[1])
    out = jax.new_ref(jnp.zeros((2 * e, kd, n), x.dtype))
    sq = jax.new_ref(jnp.zeros((2 * e, n // mosaic_tgmm.sq_tile_n(kd, n, x.dtype), kd), jnp.float32))
    tgmm(x, dy, gs, out=out, out_row=e, sq_out=sq)
    return out[...], sq[...]


@pytest.mark.skipif(_hopper.on_hopper(), reason="race detection runs in CPU interpret mode")
def test_grouped_gemm_kernels_no_races(kernel_races, monkeypatch):
    """GPU interpret mode with race detection, one launch each: the forward GEMM in both
    warpgroup splits, with the SwiGLU epilogue, transposed weights (dx), a group offset into a
    stack, the weight-gradient GEMM (also in place with its sums of squares), and the extra
    contraction (forward and transposed, 64 wide and narrow); a 136-row x with an empty group
    and rows past the sum."""
    monkeypatch.setattr(mosaic_gpu, "default_interpret",
                        lambda: _hopper.interpret_params(detect_races=True))
    gmm, tgmm = mosaic_gpu.gmm.__wrapped__, mosaic_tgmm.tgmm.__wrapped__  # traced afresh
    m, kd, n, e = 136, 128, 256, 3
    x, w, dy = operands(m, kd, n, e, seed=8)
    gs = jnp.asarray([70, 0, 50], jnp.int32)
    outs = [gmm(x, w, gs), gmm(x, w, gs, config=M_CONFIG), gmm(x, w, gs, epilogue="swiglu"),
            gmm(dy, w, gs, transpose_rhs=True),
            gmm(x, jnp.concatenate([w, w]), gs, group_offset=jnp.asarray(e, jnp.int32)),
            tgmm(x, dy, gs),
            _tgmm_with_squares(tgmm, x, dy, gs),
            gmm(x, w, gs, extra=(x[:, :64], w[:, :64])),
            gmm(dy, w, gs, transpose_rhs=True, extra=(dy[:, :128], w[:, :, :128])),
            gmm(x, w, gs, extra=(x[:, :16], w[:, :16])),
            gmm(dy, w, gs, transpose_rhs=True, extra=(dy[:, :32], w[:, :, :32]))]
    jax.block_until_ready(outs)
    assert len(kernel_races) == len(outs) and not any(kernel_races), kernel_races
    np.testing.assert_array_equal(np.asarray(outs[4], np.float32), np.asarray(outs[0], np.float32))


def test_mosaic_gmm_chained_work_items():
    """Work items chained as one pipeline of pipelines (every CTA runs two or more; interpret
    mode has 2 CTAs): whole rounds of k steps (plain, dx), and padded ones (6 k steps into 4
    slots) with the extra contraction and the SwiGLU epilogue; ragged groups, an empty one and
    rows past the sum. Against the fp32 reference."""
    m, n, e = 520, 256, 4
    gs = jnp.asarray([130, 0, 250, 100], jnp.int32)
    f32 = lambda a: a.astype(jnp.float32)
    x, w, dy = operands(m, 256, n, e, seed=21)
    out = mosaic_gpu.gmm(x, w, gs)  # bf16 out: 4 slots, 4 k steps (fp32 staging leaves 3)
    assert rel_err(out, grouped_matmul_reference(f32(x), f32(w), gs)) < 1e-2
    assert np.all(np.asarray(out, np.float32)[int(gs.sum()):] == 0)
    dx = mosaic_gpu.gmm(dy, w, gs, transpose_rhs=True)
    assert rel_err(dx, grouped_matmul_reference(f32(dy), jnp.swapaxes(f32(w), 1, 2), gs)) < 1e-2
    x, w, _ = operands(m, 384, n, e, seed=22)
    t, b = x[:, :64], w[:, :64]
    out = mosaic_gpu.gmm(x, w, gs, out_dtype=jnp.float32, extra=(t, b))
    ref = grouped_matmul_reference(f32(x), f32(w), gs) + grouped_matmul_reference(f32(t), f32(b), gs)
    assert rel_err(out, ref) < 1e-5
    act = mosaic_gpu.gmm(x, w, gs, epilogue="swiglu")
    gate, up = mosaic_gpu.deinterleave_gate_up(grouped_matmul_reference(f32(x), f32(w), gs))
    assert act.shape == (m, n // 2) and rel_err(act, jax.nn.silu(gate) * up) < 1e-2


@pytest.mark.skipif(_hopper.on_hopper(), reason="race detection runs in CPU interpret mode")
def test_chained_work_items_no_races(kernel_races, monkeypatch):
    """GPU interpret mode with race detection: work items chained as one pipeline of
    pipelines, whole rounds (plain) and padded (extra contraction), ragged groups."""
    monkeypatch.setattr(mosaic_gpu, "default_interpret",
                        lambda: _hopper.interpret_params(detect_races=True))
    gmm = mosaic_gpu.gmm.__wrapped__
    m, n, e = 512, 256, 3
    gs = jnp.asarray([200, 0, 260], jnp.int32)
    x, w, _ = operands(m, 256, n, e, seed=23)
    x3, w3, _ = operands(m, 384, n, e, seed=24)
    outs = [gmm(x, w, gs), gmm(x3, w3, gs, extra=(x3[:, :64], w3[:, :64]))]
    jax.block_until_ready(outs)
    assert len(kernel_races) == len(outs) and not any(kernel_races), kernel_races
    ref = grouped_matmul_reference(x, w, gs, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(outs[0], np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(_hopper.on_hopper(), reason="race detection runs in CPU interpret mode")
def test_whole_and_partial_tiles_store_through_both_stagings(kernel_races, monkeypatch):
    """A group that fills whole row tiles (stored from the swizzled staging) beside partial
    tiles (row-major staging, one TMA box per set bit of the row count), in both warpgroup
    splits and for dx: the reference's values, and no races between the two views."""
    monkeypatch.setattr(mosaic_gpu, "default_interpret",
                        lambda: _hopper.interpret_params(detect_races=True))
    gmm = mosaic_gpu.gmm.__wrapped__
    m, kd, n, e = 264, 128, 256, 3
    x, w, dy = operands(m, kd, n, e, seed=12)
    gs = jnp.asarray([256, 0, 5], jnp.int32)     # tiles 0-1 whole, then 5 rows and rows past the sum
    outs = [gmm(x, w, gs), gmm(x, w, gs, config=M_CONFIG), gmm(dy, w, gs, transpose_rhs=True)]
    jax.block_until_ready(outs)
    assert len(kernel_races) == len(outs) and not any(kernel_races), kernel_races
    wt = jnp.swapaxes(w, 1, 2)
    for out, (a, b) in zip(outs, [(x, w), (x, w), (dy, wt)]):
        ref = grouped_matmul_reference(a, b, gs, preferred_element_type=jnp.float32)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2)
