"""Expert parallelism: routed experts sharded over the `expert` mesh axis, tokens moved to
them inside `shard_map`, dropless.

Legend: B batch, T sequence, n = local tokens of one rank, D hidden, F expert MLP width,
E experts, El = E / ep local experts, K experts per token, ep expert-parallel size.

Dispatch ("ring of experts", all-gather / reduce-scatter, as MaxText's `use_ring_of_experts`):
every expert rank all-gathers the tokens (and their routing) of the ep ranks of its group, runs
*its* El experts on the rows routed to them (other rows go to a dummy group that the grouped
GEMM leaves at zero), weights and sums each token's rows, and `psum_scatter` returns every
token's partial sum to the rank that owns it while adding the ep partial sums. Nothing is
dropped: every (token, expert) pair is computed by exactly one rank.
Communication is 2 x (ep-1)/ep x tokens x D per layer, independent of K, which suits
DeepSeek's K = 6..8 (an all-to-all moves K copies of a token). When the MLP width is sharded
over `tensor`, each rank holds a slice of F and the down projection's partial sums are added
by a `psum` over `tensor` (Megatron column/row parallel).
The backward pass is JAX's transpose: all_gather <-> psum_scatter.

Chunks. Static shapes and no dropping mean a rank's buffers are sized for the worst case, in
which every routed row of the gathered tokens lands on its experts: ep x n x K rows. At
DeepSeek-V3 sizes (n = 4096, K = 8, ep = 8, D = 7168) one such bf16 buffer is 3.8 GB and the
reference kernels' fp32 copies double it. So the gathered tokens are processed in chunks of
at most `chunk_tokens` tokens (`default_chunk_tokens`: permuted rows of at most
DISPATCH_CHUNK_BYTES), one `lax.map` step each, the step under `jax.checkpoint`: forward and
backward keep one chunk's permuted rows, GEMM outputs and combine at a time, and the backward
recomputes a chunk's forward from its tokens instead of stashing every chunk's intermediates.
The maths and the rows each rank computes are unchanged; only their grouping into steps is.
"""
from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.fp8 import frozen as fp8_frozen
from pallas_kernels.fp8.api import fp8_swiglu
from pallas_kernels.moe import (grouped_lora_matmuls, lora_dropout,
                                permute, sorted_weights, swiglu, unpermute_sum)

EXPERT = "expert"
DISPATCH_CHUNK_BYTES = 512 << 20  # permuted rows of one chunk, at most (compute dtype)


# What an MoE block keeps for its backward under recompute (`model.moe_recompute`): the routed
# and shared experts' gate/up GEMM outputs and the routed adapters' x A (rank r, unpadded), named
# where they are made; the permuted tokens [M*K, D], the SwiGLU outputs and the dense adapters'
# products are recomputed. The expert outputs are not needed: the routing weights scale the down
# projection's input (`swiglu(g, u, w)`).
RECOMPUTE_SAVES = ("moe_gate", "moe_up", "mlp_gate", "mlp_up", "lora_t")


def with_recompute(fn, recompute: bool):
    """fn (the routed or the shared experts of an MoE block) under `jax.checkpoint` saving only
    RECOMPUTE_SAVES (`model.moe_recompute`), else fn."""
    if not recompute:
        return fn
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(*RECOMPUTE_SAVES))


def default_chunk_tokens(m: int, k: int, d: int, itemsize: int,
                         chunk_bytes: int = DISPATCH_CHUNK_BYTES) -> int:
    """Largest divisor c of m (gathered tokens) whose permuted rows c * k * d * itemsize fit in
    chunk_bytes (at least 1)."""
    best = 1
    for c in range(1, m + 1):
        if m % c == 0 and c * k * d * itemsize <= chunk_bytes:
            best = c
    return best


def _local_experts(x, ids, weights, w_gate, w_up, w_down, *, axis, mlp_axes, impl, dtype, lora=None,
                   fp8=False):
    """x [M, D]; ids/weights [M, K]; w_gate/w_up [El, D, F]; w_down [El, F, D] -> y [M, D] (fp32):
    the weighted sum of the local experts' outputs for each row (0 for rows routed elsewhere).
    lora: None or {"pairs": ((A, B) or None for gate, up, down: the local experts' factors),
    "scale", "rate", "key"}: each projection adds its per-expert adapter term over the same
    groups. With F split over `mlp_axes`, down's A is split over F too: its partial products
    are linear in A's rows, so the existing psum over `mlp_axes` adds them. fp8: the base
    GEMMs in FP8 (`pallas_kernels.fp8.frozen.grouped_gemm`), quantised from the weights as given."""
    El = w_gate.shape[0]
    e0 = jax.lax.axis_index(axis) * El
    local = ids - e0
    mine = (local >= 0) & (local < El)
    local = jnp.where(mine, local, El)  # dummy group El: sorted last, outside the GEMMs' groups
    w = jnp.where(mine, weights, 0.0)
    xs, group_sizes, perm = permute(x.astype(dtype), local, num_experts=El + 1, impl=impl)
    gs = group_sizes[:El]
    pairs, s, rate, keys = (None, None, None), 1.0, 0.0, (None, None, None)
    if lora is not None:
        pairs, s, rate, key = lora["pairs"], lora["scale"], lora["rate"], lora["key"]
        if key is not None:  # a different mask on every expert rank
            key = jax.random.fold_in(key, jax.lax.axis_index(axis))
            keys = [jax.random.fold_in(key, i) for i in range(3)]
    # one x A GEMM for the gate and up adapters; t B inside each base GEMM
    cast = (lambda w: w) if fp8 else (lambda w: w.astype(dtype))  # noqa: E731
    base = fp8_frozen.grouped_gemm if fp8 else None
    g, u = grouped_lora_matmuls(xs, (cast(w_gate), cast(w_up)), pairs[:2], gs,
                                scale=s, impl=impl, x_adapter=lora_dropout(xs, rate, keys[0]), base_gemm=base)
    w_rows = sorted_weights(w, perm)  # 0 for rows routed elsewhere
    # FP8: the SwiGLU input kept for the backward in E4M3 (`fp8_swiglu`)
    h = (fp8_swiglu if fp8 else swiglu)(checkpoint_name(g, "moe_gate"), checkpoint_name(u, "moe_up"), w_rows)
    y, = grouped_lora_matmuls(h, (cast(w_down),), pairs[2:], gs, scale=s, impl=impl,
                              x_adapter=lora_dropout(h, rate, keys[2]), base_gemm=base)
    return unpermute_sum(y, perm, ids.shape[1], impl=impl).astype(jnp.float32)


def moe_expert_parallel(x, ids, weights, w_gate, w_up, w_down, *, mesh, batch_axes=(), seq_axes=(),
                        mlp_axes=(), impl="auto", dtype=jnp.float32, axis=EXPERT, chunk_tokens=None,
                        lora=None, recompute=False, fp8=False):
    """Routed-expert output with experts sharded over mesh axis `axis`.

    Args:
      x: [B, T, D] tokens (batch over `batch_axes`, sequence over `seq_axes`).
      ids: [B, T, K] int32 expert ids in [0, E); weights: [B, T, K] fp32 routing weights.
      w_gate, w_up: [E, D, F]; w_down: [E, F, D] (any sharding: they enter the shard_map with
        experts over `axis` and F over `mlp_axes`; an FSDP-sharded D is gathered by XLA first).
      mesh: the device mesh; ep = mesh.shape[axis] must divide E.
      mlp_axes: mesh axes over which F is split (tensor parallel), () for none.
      impl: MoE kernel backend; dtype: compute dtype of the GEMMs.
      chunk_tokens: tokens per dispatch chunk on a rank (a divisor of the ep x local tokens it
        processes); None: `default_chunk_tokens`.
      lora: None, or per-expert LoRA factors {"pairs": (gate, up, down), each (A [E, in, r],
        B [E, r, out]) or None; "scale": alpha / r; "rate": dropout; "key": uint32 [2] or None}.
        A and B enter with experts over `axis`; gate/up's B and down's A split F over mlp_axes.
      recompute: keep only RECOMPUTE_SAVES of a one-chunk step for the backward and recompute
        the rest there (several chunks recompute each chunk's whole forward anyway).
      fp8: the experts' GEMMs in FP8 E4M3 (`pallas_kernels.fp8.fp8_grouped_gemm`); with F split
        over mlp_axes each rank quantises its own slice of F.
    Returns:
      [B, T, D] fp32: sum_k weights[., k] * FFN_{ids[., k]}(x), laid out like x.
    Raises:
      ValueError: ep does not divide E, or chunk_tokens does not divide a rank's tokens.
    """
    E = w_gate.shape[0]
    ep = int(dict(mesh.shape)[axis])
    if E % ep:
        raise ValueError(f"expert parallel: {E} experts are not divisible by mesh {axis}={ep}")
    ba, sa = tuple(batch_axes), tuple(seq_axes)
    tok_over_ep = axis in ba
    ma = tuple(mlp_axes) or None
    tok = P(ba or None, sa or None, None)
    wspec_in = P(axis, None, ma)
    wspec_out = P(axis, ma, None)

    pairs = lora["pairs"] if lora is not None else (None, None, None)
    lspecs = ((P(axis, None, None), P(axis, None, ma)), (P(axis, None, None), P(axis, None, ma)),
              (P(axis, ma, None), P(axis, None, None)))
    lkey = lora["key"] if lora is not None else None

    def body(x, ids, weights, wg, wu, wd, pairs, lkey):
        b, t, D = x.shape
        K = ids.shape[-1]
        xf, idf, wf = x.reshape(b * t, D), ids.reshape(b * t, K), weights.reshape(b * t, K)
        if tok_over_ep:
            xf = jax.lax.all_gather(xf, axis, axis=0, tiled=True)
            idf = jax.lax.all_gather(idf, axis, axis=0, tiled=True)
            wf = jax.lax.all_gather(wf, axis, axis=0, tiled=True)
        m = xf.shape[0]
        c = chunk_tokens or default_chunk_tokens(m, K, D, jnp.dtype(dtype).itemsize)
        if m % c:
            raise ValueError(f"expert parallel: chunk_tokens={c} does not divide the {m} tokens "
                             f"a rank processes")
        def local(xs):
            lo = None
            if lora is not None:  # the chunk's own dropout key (xs[3])
                lo = {"pairs": pairs, "scale": lora["scale"], "rate": lora["rate"], "key": xs[3]}
            return _local_experts(*xs[:3], wg, wu, wd, axis=axis, mlp_axes=ma, impl=impl, dtype=dtype,
                                  lora=lo, fp8=fp8)

        n_chunks = m // c
        keys = None if lkey is None else jax.random.split(lkey, n_chunks)
        if c == m:
            y = with_recompute(local, recompute)((xf, idf, wf, None if keys is None else keys[0]))
        else:  # one chunk per step; its intermediates are recomputed in the backward
            split = lambda a: a.reshape(m // c, c, *a.shape[1:])  # noqa: E731
            y = jax.lax.map(jax.checkpoint(local), (split(xf), split(idf), split(wf), keys))
            y = y.reshape(m, D)
        if ma:
            y = jax.lax.psum(y, ma)
        if tok_over_ep:
            y = jax.lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)
        else:
            y = jax.lax.psum(y, axis)
        return y.reshape(b, t, D)

    # check_vma=False: the reference grouped-GEMM backward scans from an unannotated zeros carry,
    # which the varying-manual-axes type check rejects; gradients are verified against 1 device
    # in tests/sharding/test_layouts.py.
    pspecs = tuple(None if p is None else s for p, s in zip(pairs, lspecs))
    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, wspec_in, wspec_in, wspec_out, pspecs,
                                                  None if lkey is None else P()),
                       out_specs=tok, check_vma=False)
    return fn(x, ids, weights, w_gate, w_up, w_down, pairs, lkey)


def moe_from_context(x, ids, weights, w_gate, w_up, w_down, *, ctx, impl="auto", dtype=jnp.float32,
                     chunk_tokens=None, lora=None, recompute=False, fp8=False):
    """`moe_expert_parallel` with axes from an active `sharding.rules.ShardingContext`; batch and
    sequence axes that do not divide x's sizes are dropped (e.g. decoding one sequence)."""
    spec = tuple(ctx.spec(("batch", "seq", None), x.shape, strict=False)) + (None, None)
    axes = lambda e: () if e is None else (tuple(e) if isinstance(e, (tuple, list)) else (e,))
    return moe_expert_parallel(
        x, ids, weights, w_gate, w_up, w_down, mesh=ctx.mesh, batch_axes=axes(spec[0]),
        seq_axes=axes(spec[1]), mlp_axes=ctx.rules.mesh_axes("mlp", ctx.mesh), impl=impl,
        dtype=dtype, chunk_tokens=chunk_tokens, lora=lora, recompute=recompute, fp8=fp8)
