"""Functional train and eval steps over the split model state.

The train state is a pytree of plain dicts:
  params   nnx.Param leaves as a pure dict (fp32 master weights)
  rest     non-parameter state (noaux_tc router biases [L_moe, E]), updated outside the optimizer
  opt      optax state;  step  int32 optimizer steps taken
  loss_scale, good_steps   dynamic loss scaling (fp16 compute only: starts at INITIAL_SCALE,
           x2 after GROWTH_INTERVAL finite steps, x0.5 and the update skipped on a non-finite one;
           1.0 otherwise)
  skipped  updates skipped for non-finite gradients;  nonfinite_step  first such step, or -1
  bad_steps  consecutive steps with non-finite gradients, 0 after a finite one (the loop stops
           the run at train.max_skipped_steps)

A batch holds `inputs, targets, loss_mask, segment_ids, positions`, each [A, B, T] where A is
train.grad_accum (micro-batches scanned). The loss is the cross-entropy summed over real target
tokens of all micro-batches divided by their count, in fp32 (a bf16 log-softmax over a 100k
vocabulary visibly quantises the loss), plus the MoE sequence-wise balance loss (weight
model.aux_loss_alpha) averaged over micro-batches, plus, with model.num_nextn_predict_layers =
K > 0, the MTP loss (DeepSeek-V3 eq. 25):
model.mtp_loss_weight / K * sum_k (fp32 CE of depth k summed over its valid targets / their count);
depth k predicts the token k + 2 ahead, masked at document boundaries, padding and row ends
(`dsjax.model.mtp.mtp_targets`).
"""
from __future__ import annotations

import operator
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from dsjax.config import Config
from dsjax.model import ModelFns
from dsjax.model import lora as lora_mod
from dsjax.model.lm_loss import lm_head_loss, num_chunks
from dsjax.model.mtp import mtp_targets
from dsjax.model.moe import EXPERT_PROJS, expert_grad_sinks, update_router_bias
from dsjax.train import finetune
from dsjax.train.finetune import grad_group_norms, token_counts
from pallas_kernels.fp8.api import fp8_copy
from pallas_kernels.fp8.stored import Fp8Copy
from pallas_kernels.moe import dw_sq_shape
from sharding import rules as shr

GROWTH_INTERVAL = 2000  # finite fp16 steps before the loss scale doubles
INITIAL_SCALE = 2.0 ** 15


def init_model(cfg: Config, seed: int | None = None):
    """Create the model (with LoRA adapters when lora.rank > 0, `finetune.init_model`);
    returns (ModelFns, params pure dict, rest pure dict)."""
    return finetune.init_model(cfg, seed)


def initial_loss_scale(cfg: Config) -> float:
    """INITIAL_SCALE under fp16 compute (dynamic loss scaling), 1.0 otherwise."""
    return INITIAL_SCALE if cfg.model.dtype == "float16" else 1.0


def init_state(params, rest, tx: optax.GradientTransformation, loss_scale: float = 1.0,
               frozen=None, compute_dtype=None, fp8_paths=frozenset()) -> dict:
    """The train state of fresh params; `loss_scale`: `initial_loss_scale(cfg)` for training.
    `frozen`: leaves that do not train (`dsjax.train.finetune`), kept under "frozen" with no
    optimizer state; None: every param trains. `compute_dtype` (the model's `dtype`): where some
    params are kept in another dtype (fp32 master weights), the state also holds their cast
    (COPY_KEY, `compute_copy`), which the train step reads and renews; None: it casts every step.
    `fp8_paths`: params whose copy is their stored E4M3 copy instead (`compute_copy`; the
    training loop passes `dsjax.train.loop.fp8_copy_paths`)."""
    state = {
        "params": params,
        "rest": rest,
        "opt": tx.init(params),
        "step": jnp.zeros((), jnp.int32),
        "loss_scale": jnp.asarray(loss_scale, jnp.float32),
        "good_steps": jnp.zeros((), jnp.int32),
        "skipped": jnp.zeros((), jnp.int32),
        "nonfinite_step": jnp.asarray(-1, jnp.int32),
        "bad_steps": jnp.zeros((), jnp.int32),
    }
    if frozen is not None:
        state["frozen"] = frozen
    if compute_dtype is not None:
        copy = compute_copy(params, compute_dtype, fp8_paths)
        if jax.tree.leaves(copy):
            state[COPY_KEY] = copy
    return state


def cross_entropy(logits, targets, mask):
    """Sum of fp32 token NLL over mask, and the mask count. logits [B, T, V]; targets/mask [B, T]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    mask = mask.astype(jnp.float32)
    return jnp.sum(nll * mask), jnp.sum(mask)


# Weights the step differentiates in fp32, not in the compute dtype: the embedding table (its
# gradient is a scatter-add over repeated tokens, which bf16 would round per addition) and the
# router gates (routing runs in fp32).
FP32_GRAD_LEAVES = ("embed_tokens", "gate")


# The state key of the compute-dtype copy of the weights (`compute_copy`), when the master
# weights are kept in another dtype. The step reads it instead of casting every master weight
# again (a read of 4 and a write of 2 bytes per fp32 parameter), and the optimizer's fused update
# writes the next one (2 bytes more per parameter in a pass that already writes the master
# weights and moments). The weights of the FP8 GEMMs may be held as their E4M3 copy instead
# (`Fp8Copy`: both block layouts, 2 bytes per parameter, and the block scales), quantised from
# the updated master weights after the update, so that the step quantises no weight.
# Checkpoints leave it out: it is a function of the params, rebuilt on restore.
COPY_KEY = "compute_params"


def is_copy_leaf(x) -> bool:
    """A leaf of a `compute_copy` tree: None (no copy), or a stored E4M3 copy (`Fp8Copy`, a
    pytree that the tree's maps must not enter); arrays are leaves anyway."""
    return x is None or isinstance(x, Fp8Copy)


def _is_cast(path, x, dtype) -> bool:
    name = str(getattr(path[-1], "key", path[-1]))
    return (name not in FP32_GRAD_LEAVES and jnp.issubdtype(x.dtype, jnp.floating)
            and x.dtype != jnp.dtype(dtype))


def compute_copy(params, dtype, fp8_paths=frozenset()):
    """The params that the forward reads in the compute `dtype`, cast to it; None where a leaf is
    used as it is (FP32_GRAD_LEAVES, integer leaves, leaves already in `dtype`). The same tree
    structure as `params`, with None leaves.

    fp8_paths: paths (tuples of dict keys) of weights [..., K, N] whose copy is their stored
      E4M3 copy (`pallas_kernels.fp8.api.fp8_copy`, quantised from the param itself, e.g. the
      fp32 master weight, not from its cast) instead of the cast: the weights an FP8 GEMM takes
      whole (`dsjax.train.loop.fp8_copy_paths`). A leaf that would not be cast (already in
      `dtype`) gets no copy of either kind."""
    def leaf(path, x):
        if not _is_cast(path, x, dtype):
            return None
        return fp8_copy(x) if lora_mod.path_names(path) in fp8_paths else x.astype(dtype)
    return jax.tree_util.tree_map_with_path(leaf, params)


def copied_fp8_paths(copy) -> frozenset[tuple[str, ...]]:
    """The paths of a `compute_copy` tree's stored E4M3 copies (its `fp8_paths`)."""
    if copy is None:
        return frozenset()
    flat = jax.tree_util.tree_flatten_with_path(copy, is_leaf=is_copy_leaf)[0]
    return frozenset(lora_mod.path_names(p) for p, x in flat if isinstance(x, Fp8Copy))


def compute_weights(params, dtype, copy=None):
    """The weights as the forward reads them: every float leaf cast to the compute `dtype`
    except FP32_GRAD_LEAVES (by leaf name). The step differentiates this copy, so gradients come
    out in the compute dtype and the cast runs once per step, not once per use; the values the
    model sees are the ones its own `astype(dtype)` casts give.

    copy: `compute_copy(params, dtype[, fp8_paths])` kept in the train state (COPY_KEY); its
      leaves are used instead of casting `params` again; a stored E4M3 copy's weight becomes its
      gradient carrier, zeros [..., K, N] in `dtype` that the forward never reads (the model
      reads the copy, joined in by `with_fp8_copies`). None: cast here."""
    if copy is None:
        copy = compute_copy(params, dtype)

    def leaf(c, p):
        if isinstance(c, Fp8Copy):
            return jnp.zeros(p.shape, dtype)
        return p if c is None else c
    return jax.tree.map(leaf, copy, params, is_leaf=is_copy_leaf)


def with_fp8_copies(weights, copy):
    """`compute_weights`' tree with each gradient carrier replaced by its stored E4M3 copy
    holding the carrier (`Fp8Copy.with_grad`): what the model reads. The FP8 GEMMs give the
    carrier the weight's gradient, so differentiating `weights` through this gives the same
    gradient tree as for cast weights. copy None: weights."""
    if copy is None or not copied_fp8_paths(copy):
        return weights
    return jax.tree.map(lambda c, w: c.with_grad(w) if isinstance(c, Fp8Copy) else w, copy, weights,
                        is_leaf=is_copy_leaf)


def checkpointed(state: dict) -> dict:
    """The train state as checkpoints hold it: without the compute-dtype copy (COPY_KEY)."""
    return {k: v for k, v in state.items() if k != COPY_KEY}


def real_counts(segment_ids):
    """(sequences with a real token, real tokens) in segment_ids [..., B, T] (0 = padding), fp32."""
    real = segment_ids > 0
    return (jnp.sum(jnp.any(real, axis=-1)).astype(jnp.float32),
            jnp.sum(real).astype(jnp.float32))


def make_train_step(cfg: Config, fns: ModelFns, tx: optax.GradientTransformation,
                    schedule: Callable, platform: str | None = None) -> Callable:
    """Returns `train_step(state, batch) -> (state, metrics)` (to be jitted with donated state).

    `platform`: what the step is compiled for ("gpu", "cpu"; default `jax.default_backend()`),
    the platform of the mesh's devices, which an ahead-of-time compile for a GPU topology sets
    on a machine without one."""
    mcfg = cfg.model
    fp16 = mcfg.dtype == "float16"
    n_accum = cfg.train.grad_accum
    # bf16/fp32 without train.skip_nonfinite: after the first non-finite gradient no update is
    # applied any more, so the state stays the last good one until the loop stops the run
    halt_on_nonfinite = not fp16 and not cfg.train.skip_nonfinite
    compute_dtype = jnp.dtype(mcfg.dtype)
    has_moe = mcfg.num_moe_layers > 0
    noaux = has_moe and mcfg.topk_method == "noaux_tc"
    n_mtp = mcfg.num_nextn_predict_layers
    mtp_noaux = n_mtp > 0 and mcfg.topk_method == "noaux_tc"
    # XLA:GPU updates weights and moments in one fused pass that reads each moment before it
    # overwrites it in place (no copies in the H200 profiles); a barrier there would split it
    # into two passes over gradients and moments (+10 bytes per parameter with fp32 moments).
    # Elsewhere (XLA:CPU, which also compiles `dsjax.plan`) the split avoids a copy of every
    # moment.
    split_moment_update = (platform or jax.default_backend()) != "gpu"

    def micro_loss(params, rest, mb, n_total, scale, n_mtp_total, n_real):
        """The micro-batch's share of the loss objective times `scale`: the lm_head + cross-
        entropy terms are formed scaled (`lm_head_loss` takes its factor), the rest is added
        and multiplied by `scale` here."""
        model = fns.merge(params, rest)
        h, aux = model.hidden_states(mb["inputs"], mb["positions"], mb["segment_ids"])
        w_out = model.lm_head_weight(h.dtype)
        B, T = mb["targets"].shape
        # chunks along T keep the batch axis's sharding; a context-sharded T is not chunked
        n_chunks = 1 if shr.context_parallel_active() else num_chunks(B, T, mcfg.vocab_size)
        lm_obj, nll_sum = lm_head_loss(h, w_out, mb["targets"], mb["loss_mask"], scale / n_total,
                                       n_chunks, mcfg.round_logits)
        obj = jnp.zeros((), jnp.float32)
        if has_moe:
            # the model averages seq_aux over this micro-batch's sequences with real tokens and
            # router_entropy over its real tokens; weigh them by those counts over the whole
            # batch, so padding and how rows fall into micro-batches change nothing
            seqs, toks = real_counts(mb["segment_ids"])
            aux = dict(aux, seq_aux=aux["seq_aux"] * seqs / n_real[0],
                       router_entropy=aux["router_entropy"] * toks / n_real[1])
            if mcfg.aux_loss_alpha > 0:
                obj = obj + mcfg.aux_loss_alpha * jnp.sum(aux["seq_aux"])
        if n_mtp:
            mtp_h, mtp_stats = model.mtp_hidden(h, mb["inputs"], mb["positions"], mb["segment_ids"])
            sums = []
            for k, hk in enumerate(mtp_h):
                tgt, mask = mtp_targets(mb["targets"], mb["loss_mask"], k)
                w_k = scale * mcfg.mtp_loss_weight / n_mtp / n_mtp_total[k]
                mtp_obj, s_k = lm_head_loss(hk, w_out, tgt, mask, w_k, n_chunks, mcfg.round_logits)
                lm_obj = lm_obj + mtp_obj
                sums.append(s_k)
            aux = dict(aux, mtp_nll=jnp.stack(sums))
            if mtp_noaux:
                aux["mtp_expert_counts"] = jnp.stack([st["expert_counts"] for st in mtp_stats])
        return lm_obj + obj * scale, (nll_sum, aux)

    # differentiates the trainable params only; frozen leaves, stored FP8 copies and the LoRA
    # dropout key ride along
    def weights_loss(weights, rest, mb, *args, copy=None, frozen=None, key=None):
        return lora_mod.with_frozen(micro_loss)(with_fp8_copies(weights, copy), rest, mb, *args,
                                                frozen=frozen, key=key)

    grad_fn = jax.value_and_grad(weights_loss, has_aux=True)

    def expert_sinks(weights):
        """({name: uninitialised ref [L * E, in, out]}, {name: its squares' ref}) for the
        trainable routed-expert stacks whose unrolled layers read their weights in place, or
        quantise them (model.fp8=blockwise: the FP8 wgrad kernel writes the sink too) (one
        device, layers unrolled, no remat and no model.moe_recompute: with jax 0.11.2 a step
        that writes a ref under `jax.checkpoint` fails at execution with an argument-count
        error): their dW kernels write the stacked gradient there, and its partial sums of
        squares into the second ref (`moe.expert_grad_sinks`). (None, None) when the model will
        not take them."""
        ctx = shr.current()
        if (not has_moe or mcfg.scan_layers or mcfg.remat != "none" or mcfg.moe_recompute
                or (ctx is not None and ctx.mesh.size > 1)):
            return None, None
        mlp = weights.get("moe_layers", {}).get("mlp", {})
        shapes = {p: (w.shape[0] * w.shape[1],) + w.shape[2:]
                  for p, w in mlp.items() if p in EXPERT_PROJS and hasattr(w, "shape")}
        if not shapes:
            return None, None
        return ({p: jax.empty_ref(jax.ShapeDtypeStruct(sh, mlp[p].dtype)) for p, sh in shapes.items()},
                {p: jax.empty_ref(jax.ShapeDtypeStruct(dw_sq_shape(sh, mlp[p].dtype), jnp.float32))
                 for p, sh in shapes.items()})

    def take_sunk(grads, dw_refs, sq_refs, used):
        """(grads with each stack whose every layer wrote its sink replaced by the sink's value,
        {name: that stack's sum of squares from its squares' ref})."""
        if not dw_refs:
            return grads, {}
        L = mcfg.num_moe_layers
        mlp = dict(grads["moe_layers"]["mlp"])
        sq = {}
        for p, ref in dw_refs.items():
            if used[p] == set(range(L)):
                mlp[p] = ref[...].reshape(mlp[p].shape)
                sq[p] = jnp.sum(sq_refs[p][...])
            elif used[p]:  # a partly written sink would give wrong gradients: fail at trace time
                raise RuntimeError(f"train_step: moe_layers.mlp.{p}: only layers {sorted(used[p])} of "
                                   f"{L} wrote their expert gradients in place")
        return dict(grads, moe_layers=dict(grads["moe_layers"], mlp=mlp)), sq

    def squares(grads, sunk_sq):
        """Per-leaf sums of squares of the fp32 gradients (the tree of grads, fp32 scalars); a
        stack written in place takes its kernels' sum (`take_sunk`), so it is not read again."""
        def leaf(path, g):
            names = lora_mod.path_names(path)
            if len(names) == 3 and names[:2] == ("moe_layers", "mlp") and names[2] in sunk_sq:
                return sunk_sq[names[2]]
            return jnp.sum(jnp.square(g))
        return jax.tree_util.tree_map_with_path(leaf, grads)

    def train_step(state, batch):
        if batch["inputs"].shape[0] != n_accum:
            raise ValueError(f"train_step: batch leading dim {batch['inputs'].shape[0]} must equal "
                             f"train.grad_accum={n_accum} (micro-batches)")
        params, rest = state["params"], state["rest"]
        frozen = state.get("frozen")
        drop_keys = lora_mod.dropout_keys(cfg.lora, cfg.train.seed, state["step"], n_accum)
        if drop_keys is not None:
            batch = dict(batch, lora_key=drop_keys)
        copy = state.get(COPY_KEY)
        if copy is not None and any(x is not None and not isinstance(x, Fp8Copy) and x.dtype != compute_dtype
                                    for x in jax.tree.leaves(copy, is_leaf=is_copy_leaf)):
            raise ValueError(f"train_step: state[{COPY_KEY!r}] is not in model.dtype={mcfg.dtype}")
        weights = compute_weights(params, compute_dtype, copy)
        scale = state["loss_scale"] if fp16 else jnp.asarray(1.0, jnp.float32)
        n_total = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
        flat = lambda x: x.reshape(-1, x.shape[-1])  # [A, B, T] -> [A*B, T]
        n_mtp_total = jnp.stack([jnp.maximum(jnp.sum(mtp_targets(
            flat(batch["targets"]), flat(batch["loss_mask"]), k)[1]), 1.0) for k in range(n_mtp)]
        ) if n_mtp else jnp.ones((0,), jnp.float32)
        n_real = tuple(jnp.maximum(c, 1.0) for c in real_counts(batch["segment_ids"]))

        def body(carry, mb):
            g_acc, nll_acc, aux_acc = carry
            (_, (nll_sum, aux)), g = grad_fn(weights, rest, mb, n_total, scale, n_mtp_total, n_real,
                                             copy=copy, frozen=frozen, key=mb.get("lora_key"))
            g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
            aux_acc = jax.tree.map(lambda a, b: a + b, aux_acc, aux)
            return (g_acc, nll_acc + nll_sum, aux_acc), None

        aux0 = {}
        if has_moe:
            L, E = mcfg.num_moe_layers, mcfg.n_routed_experts
            aux0 = {"expert_counts": jnp.zeros((L, E)), "router_entropy": jnp.zeros((L,)),
                    "seq_aux": jnp.zeros((L,))}
        if n_mtp:
            aux0["mtp_nll"] = jnp.zeros((n_mtp,))
            if mtp_noaux:
                aux0["mtp_expert_counts"] = jnp.zeros((n_mtp, mcfg.n_routed_experts))
        if n_accum == 1:  # no accumulator: saves a zero-fill and an add over every parameter
            mb = jax.tree.map(lambda x: x[0], batch)
            dw_refs, sq_refs = expert_sinks(weights)
            with expert_grad_sinks(dw_refs, sq_refs) as used:
                (_, (nll_sum, aux)), grads = grad_fn(weights, rest, mb, n_total, scale, n_mtp_total,
                                                     n_real, copy=copy, frozen=frozen, key=mb.get("lora_key"))
            grads, sunk_sq = take_sunk(grads, dw_refs, sq_refs, used)
            aux = jax.tree.map(lambda a, b: a + b, aux0, aux)
        else:
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            (grads, nll_sum, aux), _ = jax.lax.scan(body, (zeros, jnp.zeros(()), aux0), batch)
            sunk_sq = {}
        # gradients in the compute dtype (grad_accum 1) are read as fp32 by the fusions below;
        # XLA folds the upcast into the norm's reduction and the optimizer's update
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        if fp16:  # the kernels' squares are of the scaled gradients
            grads = jax.tree.map(lambda g: g / scale, grads)
            sunk_sq = {p: v / (scale * scale) for p, v in sunk_sq.items()}
        sq_tree = squares(grads, sunk_sq)
        # the sum of the per-leaf sums, in optax.tree.norm's order
        grad_norm = jnp.sqrt(jax.tree.reduce(operator.add, sq_tree, initializer=0))
        # any inf/NaN gradient makes the norm non-finite, so one reduction over the gradients
        # serves both (a finite gradient whose squares overflow fp32, |g| > 1e19, counts as
        # non-finite too: clipping could not have applied it either)
        finite = jnp.isfinite(grad_norm)
        ok = finite & (state["nonfinite_step"] < 0) if halt_on_nonfinite else finite  # apply update
        # a non-finite gradient gives non-finite updates, which `keep` discards; the clip takes
        # grad_norm (`optim.clip_by_global_norm`); an optax transform without extra arguments
        # computes its own norm of the same gradients
        norm_arg = {"grad_norm": grad_norm} if isinstance(tx, optax.GradientTransformationExtraArgs) else {}
        updates, new_opt = tx.update(grads, state["opt"], params, **norm_arg)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        new_state = dict(state)
        if split_moment_update:
            # The parameter update reads the old Adam moments, the moment update overwrites
            # them (both donated). XLA:CPU copies every moment first (2 x 10.7 GB per device for
            # DeepSeek-V3 on 256 devices); the barrier orders the overwrite after the read so the
            # moments are updated in place, and the second `tx.update` only supplies them.
            new_state["params"], opt = jax.lax.optimization_barrier(
                (keep(new_params, params), state["opt"]))
            new_state["opt"] = keep(tx.update(grads, opt, new_state["params"], **norm_arg)[1], opt)
        else:
            new_state["params"] = keep(new_params, params)
            new_state["opt"] = keep(new_opt, state["opt"])
        if copy is not None:  # the casts fused by XLA into the update pass that writes the params
            new_state[COPY_KEY] = compute_copy(new_state["params"], compute_dtype, copied_fp8_paths(copy))
        new_state["step"] = state["step"] + ok.astype(jnp.int32)
        if noaux:
            bias = rest["moe_layers"]["mlp"]["e_score_correction_bias"]
            new_bias = update_router_bias(bias, aux["expert_counts"], mcfg.router_bias_update_rate)
            new_rest = jax.tree.map(lambda x: x, rest)
            new_rest["moe_layers"]["mlp"]["e_score_correction_bias"] = jnp.where(ok, new_bias, bias)
            new_state["rest"] = new_rest
        if mtp_noaux:  # the MTP blocks' routers are balanced the same way
            new_rest = new_state["rest"] = jax.tree.map(lambda x: x, new_state["rest"])
            mlp = new_rest["mtp"]["layers"]["block"]["mlp"]
            bias = mlp["e_score_correction_bias"]
            new_bias = update_router_bias(bias, aux["mtp_expert_counts"], mcfg.router_bias_update_rate)
            mlp["e_score_correction_bias"] = jnp.where(ok, new_bias, bias)
        new_state["skipped"] = state["skipped"] + (~finite).astype(jnp.int32)
        new_state["bad_steps"] = jnp.where(finite, 0, state["bad_steps"] + 1)
        new_state["nonfinite_step"] = jnp.where(
            (state["nonfinite_step"] < 0) & ~finite, state["step"], state["nonfinite_step"])
        if fp16:
            good = jnp.where(finite, state["good_steps"] + 1, 0)
            grow = good >= GROWTH_INTERVAL
            new_state["loss_scale"] = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), scale * 0.5)
            new_state["good_steps"] = jnp.where(grow, 0, good)
        metrics = {
            "loss": nll_sum / n_total,
            "tokens": n_total,
            "grad_norm": grad_norm,
            "lr": schedule(state["step"]),
            "finite": finite,
            "loss_scale": scale,
            "skipped": new_state["skipped"],
            **grad_group_norms(sq_tree),
            **token_counts(batch),
        }
        if has_moe:
            counts = aux["expert_counts"]
            metrics["expert_load_max_over_mean"] = jnp.max(counts, -1) / jnp.maximum(jnp.mean(counts, -1), 1e-9)
            metrics["router_entropy"] = aux["router_entropy"]
            metrics["seq_aux"] = aux["seq_aux"]
        if n_mtp:
            metrics["mtp_loss"] = aux["mtp_nll"] / n_mtp_total  # [K] per-depth mean CE
        return new_state, metrics

    return train_step


def make_eval_step(cfg: Config, fns: ModelFns) -> Callable:
    """`eval_step(params, rest, batch [B, T] arrays) -> (nll_sum, n_tokens)` in fp32."""

    def eval_step(params, rest, batch):
        """params: the full tree (`dsjax.train.finetune.full_params` of a state)."""
        model = fns.merge(params, rest)
        logits, _ = model(batch["inputs"], batch["positions"], batch["segment_ids"])
        return cross_entropy(logits, batch["targets"], batch["loss_mask"])

    return eval_step
