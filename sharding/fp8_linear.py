"""The dense FP8 linear (`pallas_kernels.fp8.fp8_linear`) under a mesh: each device runs the three
FP8 GEMMs on its own tokens, inside `shard_map`; likewise the frozen FP8 weight of a LoRA run
(`pallas_kernels.fp8.frozen.fp8_linear_frozen`, forward and dgrad: `fp8_linear_frozen_from_context`).

Legend: B batch, T sequence, K input width, N output width; Bl, Tl, Kl, Nl their per-device sizes.

Left to XLA's SPMD partitioner, the Mosaic GPU kernels behind `fp8_linear(impl="mosaic")` are
opaque custom calls that it runs on gathered, replicated operands: every device would compute the
whole global batch's GEMM (as `ring_attention.local_attention` explains for the attention
kernel). Here the tokens x [B, T, K] enter `shard_map` as the activations are laid out (B over
the preset's `batch` axes, T over its `seq` axes where the sizes divide) and the weight w [K, N]
as each device needs it:
  ZeRO-3 (fsdp, and expert ranks for a dense weight): gathered whole at the `shard_map` entry;
  tensor parallel, column (K replicated, N over `tensor`: q_b_proj, kv_b_proj, gate / up): the
    device's N shard; x enters whole in K, y leaves sharded in N;
  tensor parallel, row (K over `tensor`, N replicated: o_proj, down): the device's K shard and
    x's matching K shard; the partial products are summed with `psum` over `tensor`, in the
    output dtype (as XLA sums a row-parallel dot's partials);
  a dimension whose size the mesh axes do not divide, or would divide into shards that are not
    whole 128-wide FP8 tiles, enters whole (gathered; y then leaves whole in N).
The backward follows from `shard_map`'s transpose: dw [Kl, Nl] of the device's tokens, summed
over the token axes (data, fsdp, expert, context); dx of the column-parallel GEMMs summed over
`tensor`.

FP8 tiles (DeepSeek-V3 sec. 3.3; `pallas_kernels.fp8.api`). The forward's and dgrad's 1 x 128
activation tiles run along K or N, and the weight's 128 x 128 blocks along both: a `tensor` split
keeps them whole when each shard is a multiple of 128 wide, which the config checks
(`model.fp8=blockwise` with `mesh.tensor`). The wgrad's 128 x 1 tiles run over 128 consecutive
tokens of the flattened [B * T] rows, so a device's tokens must start and end on tile bounds:
Tl a multiple of 128 when T is split, else Bl * T a multiple of 128 (`tiles_align`). Where they
do not (e.g. a batch of short rows over many devices, or decoding one token per row) this falls
back to `fp8_linear` on the global arrays, which XLA partitions with the same tiles as one
device (for the Mosaic kernels: on gathered operands, and a warning says so). Under context
parallelism with `mesh.cp_layout=striped` the global sequence is in striped order (token t at
rank t % cp), so a wgrad tile holds 128 of one rank's tokens, cp apart in the original sequence:
other groups than one device's contiguous tiles, an equally fine quantisation of dw (the
partitioner's path gives the same striped tiles); `contiguous` keeps one device's tiles.
"""
from __future__ import annotations

import warnings

import jax
from jax.sharding import PartitionSpec as P

from pallas_kernels.fp8 import api as fp8_api
from pallas_kernels.fp8.frozen import Fp8Weight, fp8_linear_frozen
from pallas_kernels.fp8.stored import Fp8Copy

TILE = 128  # tokens per wgrad tile (`pallas_kernels.fp8.reference.BLOCK`)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (tuple(entry) if isinstance(entry, (tuple, list)) else (entry,))


def _size(mesh, axes) -> int:
    shape = dict(mesh.shape)
    n = 1
    for a in axes:
        n *= int(shape[a])
    return n


def tiles_align(shape, batch_axes, seq_axes, mesh) -> bool:
    """Whether every device's tokens of x [B, T, ...] (B over `batch_axes`, T over `seq_axes`)
    cover whole 128-token tiles of the flattened [B * T] rows, so that the wgrad's 128 x 1 tiles
    on each device's tokens are the tiles of the global GEMM."""
    b, t = shape[0] // _size(mesh, batch_axes), shape[1] // _size(mesh, seq_axes)
    if _size(mesh, batch_axes) * _size(mesh, seq_axes) == 1:
        return True
    if seq_axes:
        return t % TILE == 0
    return (b * t) % TILE == 0


def fp8_linear_from_context(x, w, w_axes, *, ctx, impl: str = "auto", requantize_weight: bool = False):
    """y = `fp8_linear`(x, w) with each device's tokens local (module docstring).

    Args:
      x: [B, T, K] activations in the compute dtype (other ranks: `fp8_linear` on the global
        arrays).
      w: [K, N] master weight (any float dtype), any sharding; or its stored E4M3 copy
        (`pallas_kernels.fp8.stored.Fp8Copy`) where nothing is split (one device, or a mesh
        that splits neither tokens nor w), as `fp8_linear` takes it.
      w_axes: w's two logical axis names (e.g. ("heads", "embed")): the preset's `tensor`
        mapping of them gives the column / row split.
      ctx: the active `sharding.rules.ShardingContext` (None or a 1-device mesh: plain
        `fp8_linear`).
      impl: `fp8_linear`'s backend ("auto" | "reference" | "mosaic").
      requantize_weight: `fp8_linear`'s, where w enters it as given (one device, or nothing
        split); inside `shard_map` w may be a gathered copy, so its E4M3 copy is kept there.
    Returns:
      [B, T, N] in x.dtype, B and T laid out as x, N over `tensor` for a column-parallel w.
      Differentiable in x and w as `fp8_linear`.
    Raises:
      ValueError: as `fp8_linear` (shapes that do not contract, unknown impl); a stored copy
        under a mesh that splits the tokens or w.
    """
    backend = fp8_api.resolve_impl(impl)
    if ctx is None or ctx.mesh.size == 1 or x.ndim != 3 or w.ndim != 2 or x.shape[2] != w.shape[0]:
        # (raises its error on bad shapes)
        return fp8_api.fp8_linear(x, w, impl=backend, requantize_weight=requantize_weight)
    mesh = ctx.mesh
    tok = ctx.spec(("batch", "seq", None), x.shape, strict=False)
    ba, sa = _axes(tok[0]), _axes(tok[1])
    wspec = _weight_spec(ctx, w_axes, w.shape)
    ka, na = _axes(wspec[0]), _axes(wspec[1])
    if not (ba or sa or ka or na):  # nothing split: every device computes the whole GEMM
        return fp8_api.fp8_linear(x, w, impl=backend, requantize_weight=requantize_weight)
    if isinstance(w, Fp8Copy):
        raise ValueError("fp8_linear_from_context: a stored FP8 copy (Fp8Copy) of a weight that the mesh "
                         f"{dict(mesh.shape)} splits or gathers: the train state keeps such weights' "
                         "compute-dtype copy (`dsjax.train.loop.fp8_copy_paths`)")
    if not tiles_align(x.shape, ba, sa, mesh):
        if backend == "mosaic":
            warnings.warn(f"fp8_linear: x {list(x.shape)} over mesh {dict(mesh.shape)}: a device's "
                          f"tokens do not cover whole 128-token wgrad tiles, so the Mosaic FP8 GEMMs "
                          f"run on gathered tokens", RuntimeWarning, stacklevel=2)
        return fp8_api.fp8_linear(x, w, impl=backend)

    def body(x, w):
        y = fp8_api.fp8_linear(x, w, impl=backend)  # x [Bl, Tl, Kl], w [Kl, Nl] -> [Bl, Tl, Nl]
        return jax.lax.psum(y, ka) if ka else y

    # check_vma=False: the Mosaic kernels' loop counters fail the varying-manual-axes check (as
    # for the attention kernels); tests/sharding/test_fp8_layouts.py compares each kind of
    # split with one device's.
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(tok[0], tok[1], wspec[0]), wspec),
                       out_specs=P(tok[0], tok[1], wspec[1]), check_vma=False)
    return fn(x, w)


def _weight_spec(ctx, w_axes, shape):
    """The preset's spec of a weight [K, N] of logical axes w_axes, with a split that would cut
    a 128-wide FP8 tile dropped (that dimension gathered)."""
    mesh = ctx.mesh
    wspec = ctx.rules.spec(tuple(w_axes), shape, mesh, strict=False)
    return P(*[e if (n // _size(mesh, _axes(e))) % TILE == 0 else None for e, n in zip(wspec, shape)])


def fp8_linear_frozen_from_context(x, w: Fp8Weight, w_axes, *, ctx, impl: str = "auto"):
    """y = `fp8_linear_frozen`(x, w) with each device's tokens local: a LoRA run's frozen FP8
    weight (q [K, N] e4m3, s [Kb, Nb] block scales) under a mesh.

    As `fp8_linear_from_context` (module docstring), without the weight gradient: x [B, T, K]
    enters `shard_map` as laid out; q enters as the preset lays out w_axes (ZeRO-3: gathered
    whole; tensor parallel: the device's column or row shard, whole 128-wide blocks only, the
    row-parallel partials summed by `psum` over `tensor`) and s as the matching shard of its
    block grid, so each device's GEMMs read its own blocks as stored. Any token split works (the
    forward's and the dgrad's 1 x 128 tiles run along K or N, never across tokens).

    Args:
      x: [B, T, K] activations in the compute dtype (other ranks: `fp8_linear_frozen` on the
        global arrays). w: `Fp8Weight` [K, N]. w_axes: w's two logical axis names.
      ctx: the active `sharding.rules.ShardingContext` (None or a 1-device mesh: plain
        `fp8_linear_frozen`). impl: its backend ("auto" | "reference" | "mosaic").
    Returns:
      [B, T, N] in x.dtype, B and T laid out as x, N over `tensor` for a column-parallel w.
      Differentiable in x (w is frozen).
    Raises:
      ValueError: as `fp8_linear_frozen`.
    """
    backend = fp8_api.resolve_impl(impl)
    if (ctx is None or ctx.mesh.size == 1 or x.ndim != 3 or not isinstance(w, Fp8Weight)
            or w.ndim != 2 or x.shape[2] != w.shape[0]):
        return fp8_linear_frozen(x, w, impl=backend)  # (raises its error on bad shapes)
    mesh = ctx.mesh
    tok = ctx.spec(("batch", "seq", None), x.shape, strict=False)
    wspec = _weight_spec(ctx, w_axes, w.shape)
    ka = _axes(wspec[0])
    if not (_axes(tok[0]) or _axes(tok[1]) or ka or _axes(wspec[1])):
        return fp8_linear_frozen(x, w, impl=backend)

    def body(x, q, s):
        y = fp8_linear_frozen(x, Fp8Weight(q, s), impl=backend)  # [Bl, Tl, Kl] -> [Bl, Tl, Nl]
        return jax.lax.psum(y, ka) if ka else y

    # check_vma=False as in `fp8_linear_from_context`
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(tok[0], tok[1], wspec[0]), wspec, wspec),
                       out_specs=P(tok[0], tok[1], wspec[1]), check_vma=False)
    return fn(x, w.q, w.s)

