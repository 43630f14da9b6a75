"""Logical axis names -> mesh axes: one rules table per preset, with collision and divisibility
checks, ZeRO-3 placement of the `fsdp` axis, and the active sharding context the model reads.

The model names logical axes only. Parameters: `embed, heads, q_lora, kv_lora, mlp, experts,
vocab, norm, layers` (stacked layers lead with `layers`), and `lora`, the rank of a LoRA adapter,
which no preset maps: an adapter A [.., in, r] / B [.., r, out] is sharded by its other names like
the weight it adapts (experts over `expert`, heads / MLP over `tensor`, ZeRO-3 over `fsdp`);
activations: `batch, seq, act_heads`.
A preset's `table` maps each logical axis to a tuple of mesh axes; mesh axes of size 1 drop
out, so one preset serves any mesh that sizes only the axes it names. Rules are checked per
array: a mesh axis used by two dimensions of one array is a collision (`ShardingRuleError`),
and a dimension whose size is not a multiple of its mesh axes' product is an error naming both
(style: jax-llm-examples `deepseek_r1_jax/model.py` `ShardingRules`, `logical_to_physical`).

ZeRO-3 (FSDP). After the table, every parameter is sharded over the `fsdp` mesh axis, together
with `expert` when the array does not use it (expert ranks are data-parallel for non-expert
weights), on the first dimension, in the preset's `zero3` priority order of logical names,
whose size divides (fsdp alone if the pair does not divide). Gradients and Adam moments follow the parameter spec
(`optimizer_shardings`), so all three are 1/fsdp per device, and XLA all-gathers each layer's
weights inside the scan (ZeRO stage 3, Rajbhandari et al. 2020, arXiv 1910.02054 sec. 5).
A parameter no dimension of which divides stays replicated and is listed by `replicated_params`.
A frozen FP8 weight (`pallas_kernels.fp8.frozen.Fp8Weight`: E4M3 values q and 128 x 128 block
scales s) takes its weight's spec for q; s keeps q's mesh axes on each dimension whose size
(1/128 of q's) they divide and is replicated on the others (`fp8_scale_spec`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Any, Mapping, Sequence

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.fp8.frozen import Fp8Weight

BATCH_AXES = ("data", "fsdp", "expert")
ZERO3_AXES = ("fsdp", "expert")  # axes ZeRO-3 shards parameters over (those an array leaves free)  # mesh axes that split the batch (expert ranks are DP outside MoE)


class ShardingRuleError(ValueError):
    """A logical->mesh mapping that cannot apply: collision, non-dividing size, unused mesh axis."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """One preset: `table` logical axis -> mesh axes; `zero3` logical axes that may carry `fsdp`.

    `uses` lists the mesh axes the preset gives work to; a mesh that sizes another axis > 1 is
    rejected (`check_mesh`), so an axis is never silently replicated.
    """

    name: str
    table: Mapping[str, tuple[str, ...]]
    zero3: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()

    def mesh_axes(self, logical: str | None, mesh) -> tuple[str, ...]:
        """Mesh axes of size > 1 for one logical name (empty for None or unmapped names)."""
        if logical is None:
            return ()
        shape = dict(mesh.shape)
        return tuple(a for a in self.table.get(logical, ()) if shape.get(a, 1) > 1)

    def check_mesh(self, mesh) -> None:
        for a, n in dict(mesh.shape).items():
            if n > 1 and a not in self.uses:
                raise ShardingRuleError(
                    f"sharding: mesh axis {a}={n} is not used by preset '{self.name}' (it uses "
                    f"{', '.join(self.uses) or 'nothing'}); pick a preset that shards over {a}")

    def spec(self, logical: Sequence[str | None], shape: Sequence[int] | None, mesh, *,
             param: bool = False, where: str = "", strict: bool = True) -> P:
        """PartitionSpec for an array with logical axes `logical` and `shape` on `mesh`.

        Args:
          logical: one logical name (or None) per dimension.
          shape: the array shape (None: skip divisibility checks and ZeRO-3 placement).
          param: place the `fsdp` axis ZeRO-3 style (parameters and optimizer moments).
          where: a name for error messages (the parameter path).
          strict: raise on a non-dividing size; False drops that dimension's trailing mesh axes
            until the size divides (activations, e.g. a batch smaller than the data axes).
        Raises:
          ShardingRuleError: collision, or a size not divisible by its mesh axes.
        """
        shape_m = dict(mesh.shape)
        dims = [list(self.mesh_axes(n, mesh)) for n in logical]
        seen: dict[str, str] = {}
        for name, axes in zip(logical, dims):
            for a in axes:
                if a in seen:
                    raise ShardingRuleError(
                        f"sharding: preset '{self.name}' maps mesh axis '{a}' to both '{seen[a]}' and "
                        f"'{name}' of {where or tuple(logical)}")
                seen[a] = name
        if shape is not None:
            for i, (name, axes) in enumerate(zip(logical, dims)):
                while not strict and axes and shape[i] % math.prod(shape_m[a] for a in axes):
                    seen.pop(axes.pop())
                n = math.prod(shape_m[a] for a in axes)
                if shape[i] % n:
                    raise ShardingRuleError(
                        f"sharding: {where or tuple(logical)} dim {i} '{name}' of size {shape[i]} is not "
                        f"divisible by mesh {' x '.join(f'{a}={shape_m[a]}' for a in axes)} = {n} "
                        f"(preset '{self.name}')")
            zaxes = tuple(a for a in ZERO3_AXES if a in self.uses and shape_m.get(a, 1) > 1 and a not in seen)
            if param and self.zero3 and "fsdp" in zaxes:
                # ZeRO-3 over every data-parallel axis the array does not use (fsdp, then expert:
                # expert ranks are data-parallel for the non-expert weights); fall back to fsdp
                for cand in (zaxes, ("fsdp",)):
                    k = math.prod(shape_m[a] for a in cand)
                    hit = next((i for want in self.zero3 for i, name in enumerate(logical)
                                if name == want and shape[i] % (k * math.prod(shape_m[a] for a in dims[i])) == 0),
                               None)
                    if hit is not None:
                        dims[hit].extend(cand)
                        break
        return P(*[None if not ax else ax[0] if len(ax) == 1 else tuple(ax) for ax in dims])


# ---------------------------------------------------------------------------------------------
# Presets. Parameters: TP shards heads / MLP width (column in, row out: q_b_proj, kv_b_proj,
# gate/up [.., mlp] are column-parallel; o_proj, down [mlp, ..] row-parallel) and the vocab;
# EP shards the experts axis; CP shards the sequence; DP/FSDP/EP split the batch.
# ---------------------------------------------------------------------------------------------
_ZERO3 = ("embed", "q_lora", "kv_lora", "mlp", "heads", "vocab", "norm")
_TP = {"heads": ("tensor",), "mlp": ("tensor",), "vocab": ("tensor",), "act_heads": ("tensor",)}
_EP = {"experts": ("expert",)}
_CP = {"seq": ("context",)}


def _preset(name, uses, extra=None, zero3=_ZERO3):
    batch = tuple(a for a in BATCH_AXES if a in uses)
    table = {"batch": batch, **(extra or {})}
    return Rules(name, table, zero3 if "fsdp" in uses else (), tuple(uses))


PRESETS: dict[str, Rules] = {
    "dp": _preset("dp", ("data",)),
    "fsdp": _preset("fsdp", ("data", "fsdp")),
    "tp": _preset("tp", ("data", "fsdp", "tensor"), _TP),
    "ep": _preset("ep", ("data", "fsdp", "expert"), _EP),
    "cp": _preset("cp", ("data", "fsdp", "context"), _CP),
    "fsdp_tp_ep": _preset("fsdp_tp_ep", ("data", "fsdp", "expert", "tensor"), {**_TP, **_EP}),
    "fsdp_ep_cp": _preset("fsdp_ep_cp", ("data", "fsdp", "expert", "context"), {**_EP, **_CP}),
    "all": _preset("all", ("data", "fsdp", "expert", "tensor", "context"), {**_TP, **_EP, **_CP}),
}


def get_rules(preset: str) -> Rules:
    """Rules of a named preset. Raises ShardingRuleError naming the valid presets."""
    if preset not in PRESETS:
        raise ShardingRuleError(f"sharding: unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    return PRESETS[preset]


# ---------------------------------------------------------------------------------------------
# Trees
# ---------------------------------------------------------------------------------------------

def _is_spec(x):
    return isinstance(x, P)


def _path_name(path) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)


def fp8_scale_spec(q_spec: P, s_shape: Sequence[int], mesh) -> P:
    """Spec of the block scales s [..., Kb, Nb] of an FP8 weight whose values have `q_spec`: each
    dimension keeps q's mesh axes where their product divides its size, else is replicated."""
    shape_m = dict(mesh.shape)
    out = []
    for i, n in enumerate(s_shape):
        ax = q_spec[i] if i < len(q_spec) else None
        axes = () if ax is None else (ax if isinstance(ax, tuple) else (ax,))
        out.append(ax if axes and n % math.prod(shape_m[a] for a in axes) == 0 else None)
    return P(*out)


def tree_shardings(logical_tree, shapes_tree, mesh, rules: Rules, *, param: bool = True):
    """NamedShardings for a tree of logical PartitionSpecs (e.g. `nnx.get_partition_spec` of the
    split state, as a pure dict) and a matching tree of arrays / ShapeDtypeStructs. Where the
    shapes tree holds an `Fp8Weight` (of arrays or specs) the result holds an `Fp8Weight` of the
    two shardings (values as the weight, scales by `fp8_scale_spec`)."""
    def one(path, spec, x):
        spec = tuple(spec) + (None,) * (len(x.shape) - len(spec))
        q = rules.spec(spec, x.shape, mesh, param=param, where=_path_name(path))
        if isinstance(x, Fp8Weight):
            return Fp8Weight(NamedSharding(mesh, q), NamedSharding(mesh, fp8_scale_spec(q, x.s.shape, mesh)))
        return NamedSharding(mesh, q)
    return jax.tree_util.tree_map_with_path(one, logical_tree, shapes_tree, is_leaf=_is_spec)


def optimizer_shardings(tx, abstract_opt_state, param_shardings, mesh):
    """Shardings of an optax state: parameter-shaped leaves (Adam mu/nu) take their parameter's
    sharding; everything else (counts, schedule state) is replicated."""
    rep = NamedSharding(mesh, P())
    return optax.tree_utils.tree_map_params(
        tx, lambda _, s: s, abstract_opt_state, param_shardings,
        transform_non_params=lambda _: rep, is_leaf=lambda x: isinstance(x, NamedSharding))


def replicated_params(shardings_tree, shapes_tree) -> list[str]:
    """Paths of parameters (ndim >= 1) left fully replicated."""
    out = []

    def one(path, s, x):
        if len(x.shape) and all(a is None for a in s.spec):
            out.append(_path_name(path))
    jax.tree_util.tree_map_with_path(one, shardings_tree, shapes_tree,
                                     is_leaf=lambda x: isinstance(x, NamedSharding))
    return out


# ---------------------------------------------------------------------------------------------
# The active context: the model asks it for activation constraints and parallel attention/MoE.
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ShardingContext:
    """A mesh plus rules, active while a step is traced. `striped`: the sequence is striped over
    `context` (token t on context rank t % cp; see ring_attention.stripe)."""

    mesh: Any
    rules: Rules
    striped: bool = True

    def size(self, axis: str) -> int:
        return int(dict(self.mesh.shape).get(axis, 1))

    def spec(self, logical, shape=None, strict=True) -> P:
        return self.rules.spec(logical, shape, self.mesh, strict=strict)

    def sharding(self, logical, shape=None, strict=True) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, shape, strict))


_LOCAL = threading.local()


@contextlib.contextmanager
def use_sharding(ctx: ShardingContext | None):
    """Make `ctx` active (for tracing a step) on this thread; None deactivates."""
    prev = getattr(_LOCAL, "ctx", None)
    _LOCAL.ctx = ctx
    try:
        yield ctx
    finally:
        _LOCAL.ctx = prev


def current() -> ShardingContext | None:
    """The active ShardingContext, or None (single device, or outside a sharded step)."""
    return getattr(_LOCAL, "ctx", None)


def constrain(x, logical: Sequence[str | None]):
    """`with_sharding_constraint` of x to its logical axes under the active context (no-op when
    none is active or the mesh has one device); mesh axes that do not divide a size are dropped."""
    ctx = current()
    if ctx is None or ctx.mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, ctx.sharding(logical, x.shape, strict=False))


def context_parallel_active() -> bool:
    ctx = current()
    return ctx is not None and ctx.size("context") > 1


def expert_parallel_active() -> bool:
    ctx = current()
    return ctx is not None and ctx.size("expert") > 1
