"""Fast MoE permute: a stable counting sort by expert and Pallas Mosaic GPU row-scatter kernels.

Legend: T tokens, K top-k, D hidden, E experts, M = T*K routed rows, S sort block (rows),
B = cdiv(M, S) sort blocks, R tokens per CTA (or per pipeline step) of a row kernel.

Counting sort (`counting_sort_by_expert`): gives exactly the `perm` of the stable argsort of
the flat expert ids (ties kept in slot order), plus `dest` = its inverse (sorted row of each
slot):
  dest[i] = start[e_i] + block_prefix[b_i, e_i] + rank_i
where start is the exclusive prefix sum of the expert counts, block_prefix the exclusive
prefix sum over blocks of the per-block counts [B, E], and rank_i the number of earlier rows
of i's block with the same expert. v3 ("compare") gets rank and the block counts from two
fused compare-and-sum reductions ([B, S, S] and [B, S, E] booleans, never materialised);
v2 ("matmul") from a one-hot [B, S, E] bf16 times the strictly lower-triangular [S, S] ones
matrix (0/1 operands, fp32 accumulation: exact). The prefix over blocks is a cumulative sum
("cumsum", "lean": the expert totals from its last row) or a strictly-lower-triangular [B, B]
fp32 matmul at HIGHEST precision ("dot", exact for M < 2**24). perm is dest scattered:
perm[dest[i]] = i (an XLA scatter), unless a row kernel writes it (`with_perm=False` here,
`write_perm=True` there). The block counts can also come from an integer scatter-add ("scatter").
v4 default (`PermuteConfig`): S = `sort_block_for(E)`, "lean" prefix, scatter-add counts: 16-18
us of device time on the H200 at V2-Lite/V3 shapes, v3 (S=256, compare counts) 25 us; the rank
within blocks (M*S compares) was v3's largest kernel. `radix_sort_by_expert` gives the same
outputs from one sort of packed keys expert << bits | slot (a CUB radix sort on GPU; slower).

Row kernels (`scatter_rows`): out[dest[t, k]] = x[t]. x is read once (T*D) and the output
written once (M*D): the fewest bytes, where a gather x[perm // K] reads each token row K times.
  "tma"      (v2/v3): one CTA per R tokens: one bulk copy (cp.async.bulk, contiguous, no tensor
             map) of the R rows GMEM -> SMEM, then K*R single-row bulk stores SMEM -> GMEM. Many
             small CTAs per SM (R*D*itemsize ~ 16 KiB of SMEM each) hide the copy latency.
             v4: the K*R destination rows are read before waiting for the row load.
  "tma_pipe" (v4): persistent grid (ctas_per_sm CTAs per SM), each CTA walks token blocks
             cta, cta + G, ... through an nbuf-deep ring of SMEM buffers: the loads of the next
             nbuf-1 blocks are in flight while this block's K*R stores issue; a buffer is
             refilled once the stores of the step that read it have finished reading SMEM.
  "simt"     (v4): no SMEM: each CTA (one warpgroup, 128 threads) loads its R token rows into
             registers with 16-byte vector loads (row split across the threads, coalesced) and
             stores each row K times with vector stores; the R*K destination rows are read
             before the first store. Optionally writes perm[dest[t, k]] = t*K + k itself.
Ragged T: the last block is shifted back to end at row T and skips the rows the previous block
already stored, so every output row is written by exactly one CTA. On the H200 the three kernels
run at the same ~3.5 TB/s (wall) / ~3.75 TB/s (device) at V2-Lite and V3 shapes, whatever R,
nbuf or CTAs per SM (benchmarks/RESULTS.md, MoE "v4 permute"); "tma" is the default.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe.mosaic_gpu import on_hopper

SORT_BLOCK = 256
ROW_KERNEL_SMEM = 16 * 1024  # target SMEM bytes per CTA of the "tma" row kernel
METHODS = ("tma", "tma_pipe", "simt")


@dataclasses.dataclass(frozen=True)
class PermuteConfig:
    """What `api.permute` runs (see the module docstring).

    method: row kernel, "tma" | "tma_pipe" | "simt". rows: R (None: `default_rows`). nbuf,
    ctas_per_sm: "tma_pipe" only. write_perm: "simt" only, the kernel writes perm (the sort
    skips its scatter). sort: "counting" (`counting_sort_by_expert`) | "radix"
    (`radix_sort_by_expert`). sort_block, sort_prefix, sort_counts: the counting sort's S
    (None: `sort_block_for`), prefix and counts. Defaults: the fastest measured on the H200
    (benchmarks/RESULTS.md, MoE "v4 permute").
    """
    method: str = "tma"
    rows: int | None = None
    nbuf: int = 3
    ctas_per_sm: int = 2
    write_perm: bool = False
    sort: str = "counting"
    sort_block: int | None = None
    sort_prefix: str = "lean"
    sort_counts: str = "scatter"


DEFAULT_PERMUTE = PermuteConfig()


def counting_sort_by_expert(topk_ids, num_experts, *, block=SORT_BLOCK, method="compare",
                            prefix="cumsum", counts="compare", with_perm=True):
    """Stable counting sort of routed slots by expert.

    Args:
      topk_ids: [T, K] int in [0, num_experts).
      block: S, rows per sort block (the rank-within-block work is M * S compares).
      method: "compare" (v3: rank within a block = number of earlier rows of the block with
        the same expert, one fused compare-and-sum over [B, S, S]; block counts = a fused
        compare-and-sum over [B, S, E]) or "matmul" (v2: one-hot [B, S, E] bf16 times a
        strictly-lower-triangular [S, S] ones matrix, fp32 accumulation). Same result.
      prefix: "cumsum" (XLA cumulative sum over blocks; expert totals by a second reduction),
        "lean" (one inclusive cumulative sum over blocks; its last row gives the expert totals)
        or "dot" (strictly-lower-triangular [B, B] fp32 matmul at HIGHEST precision; exact
        while M < 2**24). Same result.
      counts: block counts [B, E] of method "compare" by a fused compare-and-sum over
        [B, S, E] ("compare") or an integer scatter-add of ones ("scatter"). Same result.
      with_perm: False skips the perm scatter (returns None for perm).
    Returns:
      group_sizes [E] int32, perm [M] int32 (== argsort(flat ids, stable=True)) or None,
      dest [T, K] int32 (dest.reshape(-1)[perm[i]] == i).
    Raises:
      ValueError: unknown method, prefix or counts.
    """
    if method not in ("compare", "matmul"):
        raise ValueError(f"method={method!r}: expected 'compare' or 'matmul'")
    if prefix not in ("cumsum", "lean", "dot"):
        raise ValueError(f"prefix={prefix!r}: expected 'cumsum', 'lean' or 'dot'")
    if counts not in ("compare", "scatter"):
        raise ValueError(f"counts={counts!r}: expected 'compare' or 'scatter'")
    t, k = topk_ids.shape
    m, e = t * k, num_experts
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    s = min(block, max(8, pl.next_power_of_2(m)))
    nb = pl.cdiv(m, s)
    padded = jnp.pad(flat, (0, nb * s - m), constant_values=e).reshape(nb, s)  # pad id e
    if method == "compare":
        earlier = jnp.tril(jnp.ones((s, s), jnp.bool_), -1)  # [i, j]: j < i
        rank = jnp.sum((padded[:, :, None] == padded[:, None, :]) & earlier, axis=2,
                       dtype=jnp.int32)  # [B, S]
        if counts == "scatter":  # pad id e lands in column e, dropped
            counts = jnp.zeros((nb, e + 1), jnp.int32).at[
                jnp.arange(nb)[:, None], padded].add(1)[:, :e]
        else:
            counts = jnp.sum(padded[:, :, None] == jnp.arange(e, dtype=jnp.int32), axis=1,
                             dtype=jnp.int32)  # [B, E]
    else:
        oh = jax.nn.one_hot(padded, e, dtype=jnp.bfloat16)  # [B, S, E]; id e: zero row
        tril = jnp.tril(jnp.ones((s, s), jnp.bfloat16), -1)
        within = jnp.einsum("ij,bje->bie", tril, oh,
                            preferred_element_type=jnp.float32).astype(jnp.int32)
        counts = jnp.sum(oh, axis=1, dtype=jnp.int32)
        ids = jnp.minimum(padded, e - 1)
        rank = jnp.take_along_axis(within, ids[..., None], axis=2)[..., 0]
    if prefix == "lean":
        inclusive = jnp.cumsum(counts, axis=0)
        block_prefix = inclusive - counts
        group_sizes = inclusive[-1].astype(jnp.int32)
    else:
        if prefix == "cumsum":
            block_prefix = jnp.cumsum(counts, axis=0) - counts
        else:
            lower = jnp.tril(jnp.ones((nb, nb), jnp.float32), -1)
            block_prefix = jnp.dot(lower, counts.astype(jnp.float32),
                                   precision=lax.Precision.HIGHEST).astype(jnp.int32)
        group_sizes = jnp.sum(counts, axis=0).astype(jnp.int32)
    start = jnp.cumsum(group_sizes) - group_sizes
    base = block_prefix + start[None, :]  # [B, E]
    ids = jnp.minimum(padded, e - 1)
    dest = (rank + jnp.take_along_axis(base, ids, axis=1)).reshape(-1)[:m].astype(jnp.int32)
    perm = None
    if with_perm:
        perm = jnp.zeros((m,), jnp.int32).at[dest].set(
            jnp.arange(m, dtype=jnp.int32), unique_indices=True, indices_are_sorted=False)
    return group_sizes, perm, dest.reshape(t, k)


def sort_block_for(num_experts):
    """S for the counting sort: the rank work is M*S compares and the prefix over blocks
    touches (M/S)*E counts, so S ~ sqrt(E); 4*sqrt(E) as a power of two, at least 16 (fitted
    on the H200: 32 at E=64 and 64 at E=256 were the fastest of 32..256)."""
    return max(16, pl.next_power_of_2(4 * math.isqrt(max(num_experts, 1))))


def radix_sort_by_expert(topk_ids, num_experts, *, with_perm=True):
    """Stable sort of routed slots by expert through one sort of packed uint32 keys.

    key = expert << bits | slot (bits = bit length of M - 1): keys are distinct, so sorting
    them orders slots by (expert, slot), the stable argsort; XLA on GPU runs a single-operand
    uint32 sort as a radix sort (CUB). group_sizes: a fused compare-and-sum over [M, E];
    dest: perm scattered. Same outputs as `counting_sort_by_expert`.

    Raises:
      ValueError: num_experts << bits does not fit 32 bits.
    """
    t, k = topk_ids.shape
    m, e = t * k, num_experts
    bits = max(1, (m - 1).bit_length())
    if e << bits > 2**32:
        raise ValueError(f"radix sort: {e} experts x {m} slots do not fit 32-bit keys")
    flat = topk_ids.reshape(-1).astype(jnp.uint32)
    keys = jnp.sort((flat << bits) | jnp.arange(m, dtype=jnp.uint32))
    perm = (keys & jnp.uint32((1 << bits) - 1)).astype(jnp.int32)
    group_sizes = jnp.sum(flat[:, None] == jnp.arange(e, dtype=jnp.uint32), axis=0,
                          dtype=jnp.int32)
    dest = jnp.zeros((m,), jnp.int32).at[perm].set(
        jnp.arange(m, dtype=jnp.int32), unique_indices=True, indices_are_sorted=False)
    return group_sizes, (perm if with_perm else None), dest.reshape(t, k)


def routing_sort(topk_ids, num_experts, config=None, *, with_perm=True):
    """The routing sort of `config` (default DEFAULT_PERMUTE): (group_sizes, perm, dest)."""
    config = config or DEFAULT_PERMUTE
    if config.sort == "radix":
        return radix_sort_by_expert(topk_ids, num_experts, with_perm=with_perm)
    if config.sort != "counting":
        raise ValueError(f"sort={config.sort!r}: expected 'counting' or 'radix'")
    block = config.sort_block or sort_block_for(num_experts)
    return counting_sort_by_expert(topk_ids, num_experts, block=block,
                                   prefix=config.sort_prefix, counts=config.sort_counts,
                                   with_perm=with_perm)


def rows_per_cta(t, d, dtype):
    """R of the "tma" kernel: a power of two with R*D*itemsize about ROW_KERNEL_SMEM, <= T."""
    row = d * jnp.dtype(dtype).itemsize
    r = 1
    while 2 * r * row <= ROW_KERNEL_SMEM and 2 * r <= t:
        r *= 2
    return r


def default_rows(method, t, d, dtype):
    """R per method when not given: "tma" `rows_per_cta`; "tma_pipe" ~8 KiB per buffer;
    "simt" ~8 KiB of registers per CTA (64 bytes per thread). Always a power of two <= T."""
    row = d * jnp.dtype(dtype).itemsize
    budget = ROW_KERNEL_SMEM if method == "tma" else 8 * 1024
    r = 1
    while 2 * r * row <= budget and 2 * r <= t:
        r *= 2
    return r


def simt_vector(d, dtype):
    """Elements per 16-byte (or narrower) vector with D % (128 * vec) == 0, or None."""
    item = jnp.dtype(dtype).itemsize
    vec = 16 // item
    while vec >= 1:
        if d % (128 * vec) == 0:
            return vec
        vec //= 2
    return None


def scatter_rows_fits(x, k, method="tma"):
    """None if `scatter_rows` takes x [T, D] (K copies per row) with this method, else why."""
    t, d = x.shape
    row = d * x.dtype.itemsize
    if row % 128:
        return f"row of {row} bytes is not a multiple of 128"
    if row > 64 * 1024:
        return f"row of {row} bytes does not fit the SMEM budget"
    if t * k >= 2**31 // max(d, 1):
        return "too many rows for int32 offsets"
    if method == "simt" and simt_vector(d, x.dtype) is None:
        return f"D={d} is not a multiple of 128 (one element per thread)"
    return None


def resolve_method(config, x, k):
    """The config's row kernel, or "tma" when the simt kernel cannot take this row width."""
    if config.method == "simt" and scatter_rows_fits(x, k, "simt") is not None:
        return "tma"
    return config.method


def _interpret_params():
    return None if on_hopper() else plgpu.InterpretGPUParams()


def _num_sms():
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 132)


def scatter_rows(x, dest, *, method="tma", rows=None, nbuf=3, ctas_per_sm=2, grid_ctas=None,
                 write_perm=False, interpret=None):
    """out[dest[t, k]] = x[t] for a permutation dest of 0..T*K-1 (Pallas Mosaic GPU).

    Args:
      x: [T, D]; dest: [T, K] int32, each of 0..T*K-1 exactly once.
      method: "tma" | "tma_pipe" | "simt" (module docstring).
      rows: R, tokens per CTA ("tma", "simt") or per pipeline step ("tma_pipe"); default
        `default_rows`.
      nbuf, ctas_per_sm, grid_ctas: "tma_pipe": ring depth, CTAs per SM, or the grid size
        itself (grid_ctas overrides ctas_per_sm * number of SMs).
      write_perm: "simt" only: also return perm [T*K] int32 with perm[dest[t, k]] = t*K + k.
      interpret: GPU interpret params (default: compiled on Hopper, interpret elsewhere).
    Returns:
      [T*K, D] in x.dtype (pure copy, exact), and perm when write_perm.
    Raises:
      ValueError: unknown method, a shape the method cannot take, write_perm without "simt".
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}: expected one of {METHODS}")
    t, d = x.shape
    k = dest.shape[1]
    reason = scatter_rows_fits(x, k, method)
    if reason:
        raise ValueError(f"scatter_rows({method}): {reason}")
    if write_perm and method != "simt":
        raise ValueError("write_perm needs method='simt'")
    r = min(rows or default_rows(method, t, d, x.dtype), t)
    interpret = interpret if interpret is not None else _interpret_params()
    dest = dest.astype(jnp.int32)
    if method == "tma":
        return _scatter_rows_tma(x, dest, r, interpret)
    if method == "tma_pipe":
        g = grid_ctas or ctas_per_sm * _num_sms()
        return _scatter_rows_tma_pipe(x, dest, r, nbuf, g, interpret)
    return _scatter_rows_simt(x, dest, r, write_perm, interpret)


def _block_start(b, r, t):
    """First token of block b, shifted back so the last block ends at row t; rows to skip."""
    first = b * r
    start = jnp.minimum(first, t - r)
    return start, first - start


def _scatter_rows_tma(x, dest, r, interpret):
    t, d = x.shape
    k = dest.shape[1]

    def permute_rows_tma(x_ref, dest_ref, o_ref, buf, bar):
        start, skip = _block_start(lax.axis_index("b"), r, t)
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(start, r)], buf, bar,
                                oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
        rows = [[dest_ref[start + i, j] for j in range(k)] for i in range(r)]  # in flight now
        plgpu.barrier_wait(bar)
        for i in range(r):
            @pl.when(i >= skip)
            def _(i=i):
                for j in range(k):
                    plgpu.copy_smem_to_gmem(buf.at[pl.ds(i, 1)], o_ref.at[pl.ds(rows[i][j], 1)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM reads done; writes land

    return plgpu.kernel(
        permute_rows_tma,
        out_type=jax.ShapeDtypeStruct((t * k, d), x.dtype),
        scratch_types=[plgpu.SMEM((r, d), x.dtype), plgpu.Barrier()],
        grid=(pl.cdiv(t, r),),
        grid_names=("b",),
        interpret=interpret,
    )(x, dest)


def _scatter_rows_tma_pipe(x, dest, r, nbuf, g, interpret):
    t, d = x.shape
    k = dest.shape[1]
    nblk = pl.cdiv(t, r)
    g = max(1, min(g, nblk))
    if nbuf < 2:
        raise ValueError(f"nbuf={nbuf}: the ring needs at least 2 buffers")

    def permute_rows_pipe(x_ref, dest_ref, o_ref, buf, bars):
        cta = lax.axis_index("g")
        steps = (nblk - 1 - cta) // g + 1  # blocks cta, cta + g, ... < nblk (cta < nblk)

        def load(step):
            start, _ = _block_start(cta + step * g, r, t)
            slot = lax.rem(step, nbuf)
            plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(start, r)], buf.at[slot], bars.at[slot],
                                    oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

        for s in range(nbuf - 1):
            @pl.when(s < steps)
            def _(s=s):
                load(jnp.int32(s))

        @pl.loop(0, steps)
        def _(step):
            start, skip = _block_start(cta + step * g, r, t)
            slot = lax.rem(step, nbuf)
            rows = [[dest_ref[start + i, j] for j in range(k)] for i in range(r)]
            plgpu.barrier_wait(bars.at[slot])
            for i in range(r):
                @pl.when(i >= skip)
                def _(i=i):
                    for j in range(k):
                        plgpu.copy_smem_to_gmem(buf.at[slot, pl.ds(i, 1)],
                                                o_ref.at[pl.ds(rows[i][j], 1)],
                                                commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            # the next load goes to the slot the previous step's stores read: wait for them
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)

            @pl.when(step + nbuf - 1 < steps)
            def _():
                load(step + nbuf - 1)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        permute_rows_pipe,
        out_type=jax.ShapeDtypeStruct((t * k, d), x.dtype),
        scratch_types=[plgpu.SMEM((nbuf, r, d), x.dtype), plgpu.Barrier(num_barriers=nbuf)],
        grid=(g,),
        grid_names=("g",),
        interpret=interpret,
    )(x, dest)


def _scatter_rows_simt(x, dest, r, write_perm, interpret):
    t, d = x.shape
    k = dest.shape[1]
    layout = plgpu.Layout.WG_STRIDED((1, d), vec_size=simt_vector(d, x.dtype))

    def permute_rows_simt(x_ref, dest_ref, o_ref, *perm_ref):
        start, skip = _block_start(lax.axis_index("b"), r, t)
        vals = [plgpu.load(x_ref.at[pl.ds(start + i, 1), :], layout=layout) for i in range(r)]
        rows = [[dest_ref[start + i, j] for j in range(k)] for i in range(r)]
        for i in range(r):
            @pl.when(i >= skip)
            def _(i=i):
                for j in range(k):
                    o_ref[pl.ds(rows[i][j], 1), :] = vals[i]
                    if write_perm:
                        perm_ref[0][rows[i][j]] = (start + i) * k + j

    out_type = [jax.ShapeDtypeStruct((t * k, d), x.dtype)]
    if write_perm:
        out_type.append(jax.ShapeDtypeStruct((t * k,), jnp.int32))
    out = plgpu.kernel(
        permute_rows_simt,
        out_type=tuple(out_type),
        grid=(pl.cdiv(t, r),),
        grid_names=("b",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                             unsafe_no_auto_barriers=True),
        interpret=interpret,
    )(x, dest)
    return tuple(out) if write_perm else out[0]


def gather_back(g, dest):
    """Backward of the permute: dx[t] = sum_k g[dest[t, k]] (fp32 sum, g.dtype out)."""
    t, k = dest.shape
    rows = jnp.take(g, dest.reshape(-1), axis=0).reshape(t, k, -1)
    return rows.astype(jnp.float32).sum(axis=1).astype(g.dtype)
