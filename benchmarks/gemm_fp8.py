"""FP8 GEMMs with DeepSeek-V3 block scales at V2-Lite's shapes: our Mosaic GPU kernel against
bf16 cuBLAS and XLA's own per-tensor FP8 dot.

    python3 benchmarks/gemm_fp8.py [--iters 20] [--reps 5] [--rows NAME,...] [--tokens 8192]
        [--pass fwd,dgrad,wgrad,linear]
    python3 benchmarks/gemm_fp8.py --tiny      # off a GPU: small shapes in GPU interpret mode
    python3 benchmarks/gemm_fp8.py --dry-run   # off a GPU: every program compiled for an H200

Rows (M = --tokens = B4 x T2048 = 8192 rows; the expert rows M x top-6 = 49152 routed rows in
64 groups of Dirichlet(50) sizes): the dense MLP's gate (or up) 2048 -> 10944 and down
10944 -> 2048, the attention projections q 2048 -> 3072, kv_a 2048 -> 576 and o 2048 -> 2048,
and the experts' fused gate|up 2048 -> 2816 and down 1408 -> 2048. Columns:

  bf16       dense rows: `jnp.dot` of bf16 (XLA's cuBLAS call); expert rows: the project's bf16
             grouped GEMM (`pallas_kernels.moe.mosaic_gpu.gmm`)
  xla f8     `lax.dot_general` of float8_e4m3fn operands (pre-quantised, per-tensor scalar
             scales applied to the fp32 result), XLA's own FP8 route, which `xla_route` reads
             off the compiled HLO: "lt-f8" (`__cublas$lt$matmul$f8`) or "fusion" (XLA's own
             generated GEMM; what compiling for the H200 without a GPU gives in jax 0.11.2);
             dense at the same M, N, K for the expert rows (no groups)
  ours       `fp8_gemm_blockwise` / `fp8_gmm_blockwise` on pre-quantised operands (1 x 128
             activation scales, 128 x 128 weight scales), Fp8Config default (tile_n 128, fold
             overlapped with the next wgmma); "ours 256" the same with tile_n 256
  +q         ours with the activations' 1 x 128 quantisation (a jnp fusion) in the timed call;
             the weights are quantised once, outside
  quant ms   the activation quantisation alone
  ours +q fused (dense rows) ours with the activation quantised by the fused kernel
             (`pallas_kernels.fp8.quantize.quantize_dual`) in the timed call: one read of x,
             x in 1 x 128 tiles for this GEMM and x^T in 128 x 1 tiles for the weight gradient
             both written (fp8_linear's forward does exactly this), only the first consumed here
  quant x2 ms (dense rows) XLA's two quantisations of x that fp8_linear needs: 1 x 128 and
             128 x 1 transposed (`reference.quantize_cols_128x1_t`)
  fused q ms (dense rows) the fused kernel alone, both layouts

Expert rows also time the backward's two grouped GEMMs (a second table), each pre-quantised
("ours") and with its operands' quantisation in the timed call ("ours +q"):

  dgrad      dx [M, K] = dy [M, N] @ w_e^T: bf16 `mosaic_gpu.gmm(dy, w [E, K, N],
             transpose_rhs=True)` against `fp8_gmm_blockwise(dy_q, dy_s, w_q [E, K, N], w_s)`
             (dy in 1 x 128 tiles, the weights' 128 x 128 blocks read as [K(out), N(contraction)])
  wgrad      dw [E, K, N] = x_e^T @ dy_e per expert: bf16 `mosaic_tgmm.tgmm(x, dy)` (bf16 dw)
             against `mosaic_grouped_wgrad.fp8_grouped_wgrad` (fp32 dw; x and dy group-padded to
             128-row tiles per expert and quantised in 128 x 1 tiles, stored transposed); "+q" adds
             that quantisation (`quantize.quantize_grouped_cols`, one kernel per operand)

Their errors: relative L2 of ours against the fp32 product of the dequantised operands (first 4
groups), and of that against the fp32 product of the unquantised ones ("quant").

TFLOP/s count 2 M N K of the real shape; K and N not multiples of 128 (10944, 576) are padded
with zeros for ours (the padded work counts as waste). Errors (relative L2): "ours" against the
fp32 sum of the dequantised block products (the kernel's own error; `ideal` is that reference
rounded to bf16 once, the least a bf16 output can have), "quant" ours against the fp32 product of
the unquantised inputs (the error of 1 x 128 / 128 x 128 e4m3 quantisation), "f8 xla" the
per-tensor FP8 dot against the same. Expert rows check the first 4 groups' rows.

--pass (default all four): "fwd" the table above; on the dense rows also "dgrad"
(dx [M, K] = dy [M, N] @ w^T: dy in 1 x 128 tiles, w [K, N] the weight in dsjax's [in, out]
layout in 128 x 128 blocks, i.e. the forward's blocks read transposed; bf16 `jnp.dot(dy, w.T)`),
"wgrad" (dw [K, N] = x^T dy, contraction over the M tokens: x^T and dy^T quantised per (row,
128 tokens), `mosaic_wgrad.fp8_gemm_1d1d`, fp32 output; bf16: XLA's dot of x and dy over M
with fp32 output; "ours ov" the kernel with the fold overlapped, "ours 256" tile_n 256; "+q"
with both transposed quantisations in the timed call) and "linear" (the whole layer forward +
backward: `jax.vjp` of `fp8_linear(x, w, impl="mosaic")` with every quantisation included,
against the same of the bf16 `x @ w`; TFLOP/s of 3 x 2 M N K, errors of y, dx and dw against
fp32, the largest of the three).

Times are the median of --reps timings of --iters back-to-back calls (`_timing.seconds`). Peak:
989 TFLOP/s bf16, 1,979 FP8 dense on an H100/H200 SXM.

`--dry-run` needs no GPU, only the CUDA plugin (`pip install "jax[cuda13]==0.11.2"`): it
compiles every row's programs for the compile-only H200 of benchmarks/h200_target_config.txtpb
(our kernels lowered for sm_90a by Mosaic GPU) and prints whether XLA's FP8 dot reaches
cuBLASLt (compiled without a GPU there is no autotuning, so the GPU run's route may differ),
to catch errors before a GPU run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _timing import seconds  # noqa: E402 (median of timed back-to-back calls)

E4M3_MAX = 448.0
BLOCK = 128
# name: (rows factor (1 dense, top-6 routed rows for experts), N, K, groups)
ROWS = {
    "mlp_gate": (1, 10944, 2048, 0),
    "mlp_down": (1, 2048, 10944, 0),
    "q_proj": (1, 3072, 2048, 0),
    "kv_a": (1, 576, 2048, 0),
    "o_proj": (1, 2048, 2048, 0),
    "expert_gate_up": (6, 2816, 2048, 64),
    "expert_down": (6, 2048, 1408, 64),
}
TINY = {"dense": (1, 320, 200, 0), "grouped": (2, 256, 256, 3)}  # --tiny: M = 256 tokens


def _pad_to(x, axis, mult):
    import jax.numpy as jnp
    pad = -x.shape[axis] % mult
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def quant_rows(x):
    """[M, K] -> (e4m3 [M, Kp], f32 scales [M, Kp/128]), Kp = K padded to 128 with zeros: per row
    and 128 columns, scale = max|x| / 448 (1 where the block is all zero)."""
    import jax.numpy as jnp
    x = _pad_to(x, 1, BLOCK).astype(jnp.float32)
    m, k = x.shape
    xb = x.reshape(m, k // BLOCK, BLOCK)
    s = jnp.max(jnp.abs(xb), -1) / E4M3_MAX
    s = jnp.where(s == 0, 1.0, s)
    q = (xb / s[..., None]).astype(jnp.float8_e4m3fn)
    return q.reshape(m, k), s


def quant_blocks(w):
    """[..., N, K] -> (e4m3 [..., Np, Kp], f32 scales [..., Np/128, Kp/128]), per 128 x 128
    block, N and K padded with zeros to multiples of 128."""
    import jax.numpy as jnp
    w = _pad_to(_pad_to(w, -1, BLOCK), -2, BLOCK).astype(jnp.float32)
    *lead, n, k = w.shape
    wb = w.reshape(*lead, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    s = jnp.max(jnp.abs(wb), (-3, -1)) / E4M3_MAX
    s = jnp.where(s == 0, 1.0, s)
    q = (wb / s[..., :, None, :, None]).astype(jnp.float8_e4m3fn)
    return q.reshape(*lead, n, k), s


def dequant(q, s):
    """Inverse of quant_rows / quant_blocks in fp32 (scales repeated over their blocks)."""
    import jax.numpy as jnp
    rep = jnp.repeat(s, BLOCK, axis=-1)
    if q.shape[-2] != s.shape[-2]:  # 128 x 128 blocks
        rep = jnp.repeat(rep, BLOCK, axis=-2)
    return q.astype(jnp.float32) * rep


def xla_fp8(a_q, b_q, sa, sb):
    """XLA's FP8 dot: e4m3 a [M, K] x e4m3 b [N, K]^T to fp32, times the per-tensor scales, to
    bf16."""
    import jax.numpy as jnp
    from jax import lax
    out = lax.dot_general(a_q, b_q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (out * (sa * sb)).astype(jnp.bfloat16)


def quant_tensor(x):
    import jax.numpy as jnp
    s = jnp.max(jnp.abs(x)).astype(jnp.float32) / E4M3_MAX
    return (x.astype(jnp.float32) / s).astype(jnp.float8_e4m3fn), s


def group_sizes(key, m, e):
    import jax
    import jax.numpy as jnp
    p = jax.random.dirichlet(key, jnp.full((e,), 50.0))
    gs = jnp.floor(p * m).astype(jnp.int32)
    return gs.at[0].add(m - gs.sum())


def build(name, spec, tokens, key, shapes_only=False):
    """Inputs and programs of one row: dict(m, n, k, e, inputs, progs [(label, jitted fn,
    args)]). shapes_only: the args are jax.ShapeDtypeStructs (nothing computed; --dry-run)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.fp8.mosaic_gemm import Fp8Config, fp8_gemm_blockwise, fp8_gmm_blockwise
    from pallas_kernels.moe import mosaic_gpu

    factor, n, k, e = spec
    m = tokens * factor
    wshape = (e, n, k) if e else (n, k)
    run = jax.eval_shape if shapes_only else (lambda f, *x: jax.jit(f)(*x))
    if shapes_only:
        a = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        w = jax.ShapeDtypeStruct(wshape, jnp.bfloat16)
        gs = jax.ShapeDtypeStruct((e,), jnp.int32) if e else None
    else:
        ka, kb, kg = jax.random.split(key, 3)
        a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kb, wshape, jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
        gs = group_sizes(kg, m, e) if e else None
    b_q, b_s = run(quant_blocks, w)  # weights: quantised once (padded N, K)
    a_q, a_s = run(quant_rows, a)
    w0 = run(lambda w: w[0], w) if e else w  # XLA's dense FP8 dot: expert 0's weight
    ta_q, ta_s = run(quant_tensor, a)
    tb_q, tb_s = run(quant_tensor, w0)
    wide = Fp8Config(tile_n=256, overlap=False)
    if e:
        ours = jax.jit(lambda a_q, a_s, b_q, b_s, gs: fp8_gmm_blockwise(a_q, a_s, b_q, b_s, gs))
        ours_w = jax.jit(lambda a_q, a_s, b_q, b_s, gs: fp8_gmm_blockwise(
            a_q, a_s, b_q, b_s, gs, config=wide))
        ours_q = jax.jit(lambda a, b_q, b_s, gs: fp8_gmm_blockwise(*quant_rows(a), b_q, b_s, gs))
        bf16 = jax.jit(lambda a, wt, gs: mosaic_gpu.gmm(a, wt, gs))
        bf16_w = run(lambda w: jnp.swapaxes(w, 1, 2), w)  # [E, K, N], transposed once
        tail = (gs,)
    else:
        ours = jax.jit(fp8_gemm_blockwise)
        ours_w = jax.jit(lambda *x: fp8_gemm_blockwise(*x, config=wide))
        ours_q = jax.jit(lambda a, b_q, b_s: fp8_gemm_blockwise(*quant_rows(a), b_q, b_s))
        bf16 = jax.jit(lambda a, w: jnp.dot(a, w.T))
        bf16_w = w
        tail = ()
    ours_args = (a_q, a_s, b_q, b_s) + tail
    progs = [("bf16", bf16, (a, bf16_w) + tail),
             ("xla f8", jax.jit(xla_fp8), (ta_q, tb_q, ta_s, tb_s)),
             ("ours", ours, ours_args)]
    if b_q.shape[-2] % 256 == 0:
        progs.append(("ours 256", ours_w, ours_args))
    progs += [("ours +q", ours_q, (a, b_q, b_s) + tail), ("quant", jax.jit(quant_rows), (a,))]
    if not e:  # the dense layer quantises x for two GEMMs: XLA's two passes vs the fused kernel
        from pallas_kernels.fp8 import reference as R
        from pallas_kernels.fp8.quantize import quantize_dual
        fused_q = jax.jit(lambda a, b_q, b_s: fp8_gemm_blockwise(
            *_fused_rows(quantize_dual(a)), b_q, b_s)[:m])
        progs += [("ours +qf", fused_q, (a, b_q, b_s)),
                  ("quant2", jax.jit(lambda a: (quant_rows(a), R.quantize_cols_128x1_t(a))), (a,)),
                  ("fused q", jax.jit(quantize_dual), (a,))]
    return dict(m=m, n=n, k=k, e=e, a=a, w=w, w0=w0, gs=gs, a_q=a_q, a_s=a_s, b_q=b_q, b_s=b_s,
                progs=progs)


def _fused_rows(outs):
    """`quantize_dual`'s 1 x 128 half (x_q [Mp, Kp], x_s [Mp, Kb]) as the GEMM takes it; the
    128 x 1 half (x^T for the weight gradient) is written by the same kernel and dropped here."""
    return outs[0], outs[1]


def wgrad_operands(x, dy, gs):
    """x [M, K], dy [M, N] -> the grouped wgrad kernel's operands as fp8_grouped_gemm makes them
    (`quantize.quantize_grouped_cols`: the group-padded layout's 128 x 1 tiles read straight from
    the rows, transposed): (xt_q [Kp, P], xt_s [P/128, Kp], dyt_q [Np, P], dyt_s [P/128, Np])."""
    from pallas_kernels.fp8.quantize import quantize_grouped_cols
    return quantize_grouped_cols(x, gs) + quantize_grouped_cols(dy, gs)


def build_grouped_bwd(row, key, shapes_only=False):
    """The expert row's backward programs: dict(dy, progs {"dgrad" | "wgrad": [(label, jitted
    fn, args)]}, operands for the errors). Forward GEMM x [M, K] @ w_e^T, w [E, N, K] ([out, in])."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.fp8.mosaic_gemm import fp8_gmm_blockwise
    from pallas_kernels.fp8.mosaic_grouped_wgrad import fp8_grouped_wgrad
    from pallas_kernels.moe import mosaic_gpu, mosaic_tgmm

    m, n, e = row["m"], row["n"], row["e"]
    run = jax.eval_shape if shapes_only else (lambda f, *x: jax.jit(f)(*x))
    if shapes_only:
        dy = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    else:
        dy = jax.random.normal(key, (m, n), jnp.float32).astype(jnp.bfloat16)
    a, w, gs = row["a"], row["w"], row["gs"]
    w_kn = run(lambda w: jnp.swapaxes(w, 1, 2), w)  # [E, K, N] bf16: dx = dy @ w_kn[g]^T
    wt_q, wt_s = run(quant_blocks, w_kn)            # [E, Kp, Np], [E, Kp/128, Np/128]
    dy_q, dy_s = run(quant_rows, dy)
    wg_ops = run(wgrad_operands, a, dy, gs)
    dgrad = [("bf16", jax.jit(lambda dy, w, gs: mosaic_gpu.gmm(dy, w, gs, transpose_rhs=True)),
              (dy, w_kn, gs)),
             ("ours", jax.jit(lambda *x: fp8_gmm_blockwise(*x)), (dy_q, dy_s, wt_q, wt_s, gs)),
             ("ours +q", jax.jit(lambda dy, wq, ws, gs: fp8_gmm_blockwise(*quant_rows(dy), wq, ws, gs)),
              (dy, wt_q, wt_s, gs))]
    wgrad = [("bf16", jax.jit(lambda x, dy, gs: mosaic_tgmm.tgmm(x, dy, gs)), (a, dy, gs)),
             ("ours", jax.jit(lambda *x: fp8_grouped_wgrad(*x)), wg_ops + (gs,)),
             ("ours +q", jax.jit(lambda x, dy, gs: fp8_grouped_wgrad(*wgrad_operands(x, dy, gs), gs)),
              (a, dy, gs))]
    return dict(dy=dy, dy_q=dy_q, dy_s=dy_s, wt_q=wt_q, wt_s=wt_s, wg_ops=wg_ops,
                progs={"dgrad": dgrad, "wgrad": wgrad})


def grouped_bwd_errors(row, bwd, outs):
    """{"dgrad" | "wgrad": (err ours, err quant)} on the first 4 groups (module docstring)."""
    import jax.numpy as jnp
    hp = "highest"
    err = lambda x, ref: float(jnp.linalg.norm(x.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    k, n = row["k"], row["n"]
    gs = [int(g) for g in row["gs"]]
    starts = [sum(gs[:g]) for g in range(len(gs))]
    res = {}
    # dgrad: rows of groups 0..3
    hi = sum(gs[:4])
    dyd = dequant(bwd["dy_q"], bwd["dy_s"])[:hi]
    refs_q, refs_x = [], []
    for g in range(min(4, len(gs))):
        rows = slice(starts[g], starts[g] + gs[g])
        wd = dequant(bwd["wt_q"][g], bwd["wt_s"][g])  # [Kp, Np]
        refs_q.append(jnp.dot(dyd[rows], wd.T, precision=hp)[:, :k])
        refs_x.append(jnp.dot(bwd["dy"][rows].astype(jnp.float32),
                              row["w"][g].astype(jnp.float32), precision=hp))
    ref_q, ref_x = jnp.concatenate(refs_q), jnp.concatenate(refs_x)
    res["dgrad"] = (err(outs["dgrad"][:hi, :k], ref_q), err(ref_q, ref_x))
    # wgrad: groups 0..3 from the tiles of each (`reference.group_tiles`)
    from pallas_kernels.fp8 import reference as R
    first, count = ([int(v) for v in a] for a in R.group_tiles(row["gs"]))
    g4 = min(4, len(gs))
    p4 = (first[g4 - 1] + count[g4 - 1]) * BLOCK  # the padded rows of groups 0..3
    xt_q, xt_s, dyt_q, dyt_s = (o[..., :p4] if i % 2 == 0 else o[:p4 // BLOCK]
                                for i, o in enumerate(bwd["wg_ops"]))
    xd = xt_q.astype(jnp.float32) * jnp.repeat(xt_s.T, BLOCK, axis=1)     # [Kp, p4]
    dd = dyt_q.astype(jnp.float32) * jnp.repeat(dyt_s.T, BLOCK, axis=1)   # [Np, p4]
    e_q, e_x = [], []
    for g in range(g4):
        cols = slice(first[g] * BLOCK, (first[g] + count[g]) * BLOCK)
        rows = slice(starts[g], starts[g] + gs[g])
        e_q.append((outs["wgrad"][g][:k, :n], jnp.dot(xd[:k, cols], dd[:n, cols].T, precision=hp)))
        e_x.append(jnp.dot(row["a"][rows].astype(jnp.float32).T,
                           bwd["dy"][rows].astype(jnp.float32), precision=hp))
    got = jnp.stack([o for o, _ in e_q])
    ref_q = jnp.stack([r for _, r in e_q])
    res["wgrad"] = (err(got, ref_q), err(ref_q, jnp.stack(e_x)))
    return res


def errors(row, outs):
    """Relative L2 errors of the row (docstring of the module), on the expert rows' first 4
    groups."""
    import jax.numpy as jnp
    m, n, k = row["m"], row["n"], row["k"]
    hp = "highest"
    err = lambda x, ref: float(jnp.linalg.norm(x.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    kp = row["a_q"].shape[1]
    ad = dequant(row["a_q"], row["a_s"])
    if row["e"]:
        gs = [int(g) for g in row["gs"]]
        lo, refs_q, refs_x, hi = 0, [], [], 0
        for g in range(min(4, len(gs))):
            hi = lo + gs[g]
            bd = dequant(row["b_q"][g], row["b_s"][g])[:n, :kp]
            refs_q.append(jnp.dot(ad[lo:hi], bd.T, precision=hp))
            refs_x.append(jnp.dot(row["a"][lo:hi].astype(jnp.float32),
                                  row["w"][g].astype(jnp.float32).T, precision=hp))
            lo = hi
        ref_q, ref_x, rows = jnp.concatenate(refs_q), jnp.concatenate(refs_x), slice(0, hi)
    else:
        bd = dequant(row["b_q"], row["b_s"])[:n, :kp]
        ref_q = jnp.dot(ad, bd.T, precision=hp)
        ref_x = jnp.dot(row["a"].astype(jnp.float32), row["w"].astype(jnp.float32).T, precision=hp)
        rows = slice(0, m)
    ours = outs["ours"][rows, :n]
    res = dict(ours=err(ours, ref_q), ideal=err(ref_q.astype(jnp.bfloat16), ref_q),
               quant=err(ours, ref_x))
    ref_x_dense = ref_x if not row["e"] else jnp.dot(  # XLA's dot: expert 0's weight, all rows
        row["a"].astype(jnp.float32), row["w0"].astype(jnp.float32).T, precision=hp)
    res["f8 xla"] = err(outs["xla f8"], ref_x_dense)
    return res


def xla_route(hlo_text):
    """How XLA compiled the FP8 dot, from the compiled HLO: "lt-f8" (a `__cublas$lt$matmul$f8`
    call), "cublas" (another cuBLAS call: the FP8 operands were converted), "fusion" (XLA's
    own generated GEMM, a `gemm_fusion` with f8 operands), or "?"."""
    if "__cublas$lt$matmul$f8" in hlo_text:
        return "lt-f8"
    if "__cublas$" in hlo_text:
        return "cublas"
    if "gemm_fusion" in hlo_text and "f8e4m3fn" in hlo_text:
        return "fusion"
    return "?"


PASSES = ("fwd", "dgrad", "wgrad", "linear")


def build_pass(pass_, spec, tokens, key, shapes_only=False):
    """Programs of one dense row's dgrad, wgrad or whole-linear pass (module docstring):
    dict(m, n, k, flops, progs [(label, jitted fn, args)], refs: fn(outs) -> errors)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from pallas_kernels.fp8 import fp8_linear
    from pallas_kernels.fp8.mosaic_gemm import Fp8Config, fp8_gemm_blockwise
    from pallas_kernels.fp8.mosaic_wgrad import fp8_gemm_1d1d

    _, n, k, _ = spec
    m = tokens
    run = jax.eval_shape if shapes_only else (lambda f, *x: jax.jit(f)(*x))
    if shapes_only:
        x, dy, w = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (m, n), (k, n)))
    else:
        kx, kd, kw = jax.random.split(key, 3)
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        dy = jax.random.normal(kd, (m, n), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
    f32, hp = jnp.float32, "highest"
    err = lambda a, ref: float(jnp.linalg.norm(a.astype(f32) - ref) / jnp.linalg.norm(ref))  # noqa: E731
    if pass_ == "dgrad":
        w_q, w_s = run(quant_blocks, w)  # [Kp, Np]: the kernel's b [N_out = K, contraction N]
        dy_q, dy_s = run(quant_rows, dy)
        ours = jax.jit(lambda a, s, b, bs: fp8_gemm_blockwise(a, s, b, bs)[:, :k])
        ours_q = jax.jit(lambda dy, b, bs: fp8_gemm_blockwise(*quant_rows(dy), b, bs)[:, :k])
        progs = [("bf16", jax.jit(lambda dy, w: jnp.dot(dy, w.T)), (dy, w)),
                 ("ours", ours, (dy_q, dy_s, w_q, w_s))]
        if w_q.shape[0] % 256 == 0:
            wide = Fp8Config(tile_n=256, overlap=False)
            progs.append(("ours 256", jax.jit(lambda a, s, b, bs: fp8_gemm_blockwise(
                a, s, b, bs, config=wide)[:, :k]), (dy_q, dy_s, w_q, w_s)))
        progs.append(("ours +q", ours_q, (dy, w_q, w_s)))

        def refs(outs):
            ref_q = jnp.dot(dequant(dy_q, dy_s), dequant(w_q, w_s).T, precision=hp)[:, :k]
            ref_x = jnp.dot(dy.astype(f32), w.astype(f32).T, precision=hp)
            return dict(ours=err(outs["ours"], ref_q), ideal=err(ref_q.astype(jnp.bfloat16), ref_q),
                        quant=err(outs["ours"], ref_x))
        return dict(m=m, n=n, k=k, flops=2 * m * n * k, progs=progs, refs=refs)
    if pass_ == "wgrad":
        def quant_t(x, rows_to=1):
            """x [M, C] -> x^T [C, M] quantised per (row, 128 tokens), rows padded to rows_to."""
            return quant_rows(_pad_to(x.T, 0, rows_to))
        xt_q, xt_s = run(quant_t, x)
        dyt_q, dyt_s = run(lambda d: quant_t(d, BLOCK), dy)
        ops = (xt_q, xt_s, dyt_q, dyt_s)
        mk = lambda cfg=None: jax.jit(lambda *o: fp8_gemm_1d1d(*o, config=cfg)[:, :n])  # noqa: E731
        bf16 = jax.jit(lambda x, dy: lax.dot_general(x, dy, (((0,), (0,)), ((), ())),
                                                      preferred_element_type=f32))
        progs = [("bf16", bf16, (x, dy)), ("ours", mk(), ops),
                 ("ours ov", mk(Fp8Config(overlap=True)), ops)]
        if dyt_q.shape[0] % 256 == 0:
            progs.append(("ours 256", mk(Fp8Config(tile_n=256, overlap=False)), ops))
        progs.append(("ours +q", jax.jit(lambda x, dy: fp8_gemm_1d1d(
            *quant_t(x), *quant_t(dy, BLOCK))[:, :n]), (x, dy)))

        def refs(outs):
            ref_q = jnp.dot(dequant(xt_q, xt_s), dequant(dyt_q, dyt_s).T, precision=hp)[:, :n]
            ref_x = jnp.dot(x.astype(f32).T, dy.astype(f32), precision=hp)
            return dict(ours=err(outs["ours"], ref_q), ideal=0.0, quant=err(outs["ours"], ref_x))
        return dict(m=m, n=n, k=k, flops=2 * m * n * k, progs=progs, refs=refs)

    def fwd_bwd(f):
        def run_(x, w, dy):
            y, vjp = jax.vjp(f, x, w)
            return (y,) + vjp(dy)
        return jax.jit(run_)
    progs = [("bf16", fwd_bwd(lambda x, w: x @ w), (x, w, dy)),
             ("ours", fwd_bwd(lambda x, w: fp8_linear(x, w, impl="mosaic")), (x, w, dy))]

    def refs(outs):
        x32, w32, dy32 = x.astype(f32), w.astype(f32), dy.astype(f32)
        exact = (jnp.dot(x32, w32, precision=hp), jnp.dot(dy32, w32.T, precision=hp),
                 jnp.dot(x32.T, dy32, precision=hp))
        worst = lambda o: max(err(a, e) for a, e in zip(o, exact))  # noqa: E731
        return dict(ours=worst(outs["ours"]), bf16=worst(outs["bf16"]))
    return dict(m=m, n=n, k=k, flops=6 * m * n * k, progs=progs, refs=refs)


def run_passes(passes, names, specs, tokens, iters, reps):
    """Time the dgrad / wgrad / linear passes of the dense rows; prints one table per pass."""
    import jax

    for pass_ in passes:
        table = []
        for i, name in enumerate(n for n in names if not specs[n][3]):
            row = build_pass(pass_, specs[name], tokens, jax.random.key(100 + i))
            outs, ms = {}, {}
            for label, fn, fargs in row["progs"]:
                outs[label] = fn(*fargs)
                ms[label] = seconds(fn, fargs, iters, reps) * 1e3
            errs = row["refs"](outs)
            table.append((name, row, ms, errs))
            print(pass_, name, {lb: f"{t:.3f} ms" for lb, t in ms.items()},
                  {k: f"{v:.1e}" for k, v in errs.items()}, flush=True)
            del row, outs
        print(f"\n{pass_}: TFLOP/s of {row_flops(pass_)} (real shape); ms per call\n")
        if pass_ == "linear":
            print("| row | M | N | K | bf16 ms | fp8 ms | fp8 / bf16 speed | bf16 TF | fp8 TF "
                  "| err fp8 | err bf16 |\n" + "|---" * 11 + "|")
            for name, row, ms, errs in table:
                tf = lambda lb: row["flops"] / ms[lb] / 1e9  # noqa: E731
                print(f"| {name} | {row['m']} | {row['n']} | {row['k']} | {ms['bf16']:.3f} "
                      f"| {ms['ours']:.3f} | {ms['bf16'] / ms['ours']:.2f}x | {tf('bf16'):.0f} "
                      f"| {tf('ours'):.0f} | {errs['ours']:.1e} | {errs['bf16']:.1e} |")
            continue
        print("| row | M | N | K | bf16 | ours | ours ov | ours 256 | ours +q | err ours | ideal "
              "| err quant |\n" + "|---" * 12 + "|")
        for name, row, ms, errs in table:
            tf = lambda lb: (f"{row['flops'] / ms[lb] / 1e9:.0f}" if lb in ms else "-")  # noqa: E731
            print(f"| {name} | {row['m']} | {row['n']} | {row['k']} | {tf('bf16')} | {tf('ours')} "
                  f"| {tf('ours ov')} | {tf('ours 256')} | {tf('ours +q')} "
                  f"| {errs['ours']:.1e} | {errs['ideal']:.1e} | {errs['quant']:.1e} |")


def row_flops(pass_):
    return "3 x 2 M N K" if pass_ == "linear" else "2 M N K"


def dry_run(names, tokens, passes=("fwd",)):
    """Compile every row's programs for the compile-only H200 (no GPU; needs the CUDA plugin)."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    import jax
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from pallas_kernels._hopper import target_device

    with open(os.path.join(HERE, "h200_target_config.txtpb")) as f:
        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=f.read())
    dev = topo.devices[0]
    sh = SingleDeviceSharding(dev)

    def abstract(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)

    with target_device(dev):
        jobs = [(name, "fwd") for name in names if "fwd" in passes]
        jobs += [(name, p) for p in passes if p != "fwd" for name in names if not ROWS[name][3]]
        for name, pass_ in jobs:
            row = (build(name, ROWS[name], tokens, None, shapes_only=True) if pass_ == "fwd" else
                   build_pass(pass_, ROWS[name], tokens, None, shapes_only=True))
            for label, fn, args in row["progs"]:
                t0 = time.perf_counter()
                text = fn.lower(*map(abstract, args)).compile().as_text()
                extra = ""
                if label == "xla f8":
                    extra = f" XLA's route: {xla_route(text)}"
                elif label.startswith("ours"):
                    calls = text.count('custom_call_target="mosaic_gpu')
                    extra = f" Mosaic GPU calls: {calls}"
                print(f"{name:<15} {pass_:<6} {label:<9} compiled for {dev.device_kind} in "
                      f"{time.perf_counter() - t0:.1f} s{extra}", flush=True)
            if pass_ != "fwd" or not row["e"]:  # the grouped backward: once, from the fwd row
                continue
            for gemm, progs in build_grouped_bwd(row, None, shapes_only=True)["progs"].items():
                for label, fn, args in progs:
                    t0 = time.perf_counter()
                    text = fn.lower(*map(abstract, args)).compile().as_text()
                    calls = text.count('custom_call_target="mosaic_gpu')
                    print(f"{name:<15} {gemm} {label:<9} compiled for {dev.device_kind} in "
                          f"{time.perf_counter() - t0:.1f} s Mosaic GPU calls: {calls}", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=8192, help="rows of the dense GEMMs (B x T)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {list(ROWS)}")
    p.add_argument("--pass", dest="passes", default=",".join(PASSES),
                   help=f"comma list of {list(PASSES)} (module docstring)")
    p.add_argument("--tiny", action="store_true", help="small shapes in GPU interpret mode (no GPU)")
    p.add_argument("--dry-run", action="store_true",
                   help="compile every program for an H200 without running (no GPU; CUDA plugin)")
    args = p.parse_args(argv)
    names = [r for r in args.rows.split(",") if r]
    bad = [r for r in names if r not in ROWS]
    if bad:
        print(f"--rows: unknown {bad}; known {list(ROWS)}", file=sys.stderr)
        return 2
    passes = [x for x in args.passes.split(",") if x]
    bad = [x for x in passes if x not in PASSES]
    if bad or not passes:
        print(f"--pass: unknown {bad or passes}; known {list(PASSES)}", file=sys.stderr)
        return 2
    if args.dry_run or args.tiny:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("PJRT_NPROC", "8")  # interpret mode under jit (_hopper)
    if args.dry_run:
        return dry_run(names, args.tokens, passes)
    import jax


    specs = dict(ROWS)
    if args.tiny:
        specs, names, args.tokens, args.iters, args.reps = TINY, list(TINY), 256, 1, 1
    table, bwd_table = [], []  # the expert rows' backward GEMMs run with their forward ("fwd")
    for i, name in enumerate(names if "fwd" in passes else []):
        row = build(name, specs[name], args.tokens, jax.random.key(i))
        outs, ms, lt = {}, {}, None
        for label, fn, fargs in row["progs"]:
            outs[label] = fn(*fargs)
            if label == "xla f8" and not args.tiny:
                lt = xla_route(fn.lower(*fargs).compile().as_text())
            ms[label] = seconds(fn, fargs, args.iters, args.reps) * 1e3
        errs = errors(row, outs)
        qms = {lb: ms[lb] for lb in QUANT_LABELS if lb in ms}
        tf = {lb: flops_of(row) / t / 1e9 for lb, t in ms.items() if lb not in QUANT_LABELS}
        table.append((name, row, tf, qms, lt, errs))
        print(name, {k: round(v) for k, v in tf.items()},
              {k: f"{v:.3f} ms" for k, v in qms.items()}, lt,
              {k: f"{v:.1e}" for k, v in errs.items()}, flush=True)
        if row["e"]:
            bwd = build_grouped_bwd(row, jax.random.key(100 + i))
            bouts, btf = {}, {}
            for gemm, progs in bwd["progs"].items():
                for label, fn, fargs in progs:
                    out = fn(*fargs)
                    if label == "ours":
                        bouts[gemm] = out
                    btf[gemm, label] = flops_of(row) / seconds(fn, fargs, args.iters, args.reps) / 1e12
            berrs = grouped_bwd_errors(row, bwd, bouts)
            bwd_table.append((name, row, btf, berrs))
            print(name, "backward", {f"{g} {lb}": round(v) for (g, lb), v in btf.items()},
                  {g: f"{a:.1e} / {b:.1e}" for g, (a, b) in berrs.items()}, flush=True)
            del bwd, bouts
        del row, outs
    dev = jax.devices()[0]
    print(f"\n{dev.device_kind}, jax {jax.__version__}; median of {args.reps} x {args.iters} calls; "
          f"TFLOP/s of 2 M N K (real shape)\n")
    if table:
        print("| row | M | N | K | E | bf16 | xla f8 (route) | ours | ours 256 | ours +q "
              "| ours +q fused | quant ms | quant x2 ms | fused q ms "
              "| err ours | ideal | err quant | err f8 xla |\n" + "|---" * 18 + "|")
    for name, row, tf, qms, lt, errs in table:
        lt_s = lt or "-"
        q = lambda lb: f"{qms[lb]:.3f}" if lb in qms else "-"  # noqa: E731
        print(f"| {name} | {row['m']} | {row['n']} | {row['k']} | {row['e'] or '-'} "
              f"| {tf['bf16']:.0f} | {tf['xla f8']:.0f} ({lt_s}) | {tf['ours']:.0f} "
              f"| {tf.get('ours 256', float('nan')):.0f} | {tf['ours +q']:.0f} "
              f"| {tf.get('ours +qf', float('nan')):.0f} | {q('quant')} | {q('quant2')} "
              f"| {q('fused q')} | {errs['ours']:.1e} | {errs['ideal']:.1e} | {errs['quant']:.1e} "
              f"| {errs['f8 xla']:.1e} |")
    if bwd_table:
        print("\nExpert rows' backward GEMMs (TFLOP/s of 2 M N K; errors: ours vs the dequantised "
              "operands' fp32 product / that vs the unquantised one)\n")
        print("| row | GEMM | bf16 | ours | ours +q | err ours | err quant |\n" + "|---" * 7 + "|")
        for name, row, btf, berrs in bwd_table:
            for gemm in ("dgrad", "wgrad"):
                print(f"| {name} | {gemm} | {btf[gemm, 'bf16']:.0f} | {btf[gemm, 'ours']:.0f} "
                      f"| {btf[gemm, 'ours +q']:.0f} | {berrs[gemm][0]:.1e} | {berrs[gemm][1]:.1e} |")
    run_passes([p for p in passes if p != "fwd"], names, specs, args.tokens, args.iters, args.reps)
    return 0


QUANT_LABELS = ("quant", "quant2", "fused q")  # timed in ms, not TFLOP/s


def flops_of(row):
    """2 M N K of a row's real shape (each of the three GEMMs of a linear layer)."""
    return 2 * row["m"] * row["n"] * row["k"]


if __name__ == "__main__":
    sys.exit(main())
