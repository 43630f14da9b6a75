"""The training loop: data, model, optimizer, jitted step, metrics, evaluation, checkpoints.

`train(cfg, resume=False)` is what `python -m dsjax.train` runs. Run directory layout:
  RUN_DIR/config.yaml        the resolved config
  RUN_DIR/tokenizer.json     the tokenizer used (for generation and export)
  RUN_DIR/metrics.jsonl      one JSON object per logged step / evaluation
  RUN_DIR/tb/                TensorBoard event files
  RUN_DIR/checkpoints/<step> orbax checkpoints (state, data-loader position, config)
In a multi-process run orbax writes the checkpoints collectively; every other file of RUN_DIR
(config.yaml, the tokenizer files, metrics.jsonl, tb/, checksums, moving damaged steps aside) is
written by process 0 only, and only process 0 prints progress (the others' log records carry a
"[process N]" prefix).

Parallelism (`setup_parallel`): `sharding.distributed.initialize` first (multi-host), then the
mesh of `cfg.mesh` and its rules preset. The state is created directly in its sharded layout
(parameters, gradients and Adam moments per `sharding.rules`), each process feeds its rows of
the global batch (`jax.make_array_from_process_local_data`, sequence striped over `context`
for ring attention), and the step is jitted with those shardings while the rules are active,
so the model's logical constraints, ring attention and expert parallelism apply. A checkpoint
restores into the shardings of the *current* mesh, whatever mesh wrote it (a run saved on 8
devices continues on 2 or 1).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from dsjax import config as C
from dsjax.checkpoint import Checkpointer, abstract_like
from dsjax.config.checks import check_moe_kernel_rows
from dsjax.config.paths import check_paths
from dsjax.data import Documents, PackedLoader, chat, expand_sources, load_or_train, split_files, stdlib_files
from dsjax.errors import RunStopped
from dsjax.hf import load_hf_params
from dsjax.train import finetune, runs
from dsjax.train.metrics import MetricsWriter, device_peak_flops, flops_per_token
from dsjax.train.optim import build_optimizer
from dsjax.train.step import (COPY_KEY, checkpointed, compute_copy, copied_fp8_paths, init_model, init_state,
                              initial_loss_scale, is_copy_leaf, make_eval_step, make_train_step)
from pallas_kernels.fp8.stored import Fp8Copy
from sharding import distributed as sdist
from sharding import rules as shr
from sharding.mesh import make_mesh
from sharding.ring_attention import stripe

log = logging.getLogger("dsjax.train")
SIGTERM_EXIT = 143
MIN_BPE_VOCAB = 258  # the trained BPE's 256 byte symbols and its EOS and pad tokens


class NonFiniteError(RunStopped):
    """Non-finite training: gradients under bf16/fp32 without skipping, train.max_skipped_steps
    consecutive skipped steps (fp16 loss scaling or train.skip_nonfinite), or a non-finite
    validation loss."""


@dataclasses.dataclass(frozen=True)
class Parallel:
    """The mesh, its rules preset and the context the model reads while a step is traced."""

    mesh: jax.sharding.Mesh
    rules: shr.Rules
    ctx: shr.ShardingContext

    @property
    def cp(self) -> int:
        return self.ctx.size("context") if self.ctx.striped else 1

    def batch_sharding(self, ndim: int, shape=None) -> NamedSharding:
        """[B, T] (ndim 2) or [A, B, T] (ndim 3) batch arrays: batch over the data axes, T over
        context. Given `shape`, batch axes that do not divide B are dropped (replicated)."""
        logical = ("batch", "seq") if ndim == 2 else (None, "batch", "seq")
        return NamedSharding(self.mesh, self.rules.spec(logical, shape, self.mesh, strict=shape is None))


def _prefix_secondary_logs() -> None:
    """On processes other than 0 of a multi-process run, prefix the dsjax and sharding log
    records with "[process N]" (once per process)."""
    index = jax.process_index()
    if index == 0 or getattr(logging.getLogRecordFactory(), "dsjax_process", None) is not None:
        return
    base = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = base(*args, **kwargs)
        if record.name.split(".")[0] in ("dsjax", "sharding"):
            record.msg = f"[process {index}] {record.msg}"
        return record

    factory.dsjax_process = index
    logging.setLogRecordFactory(factory)


def setup_parallel(cfg: C.Config, devices=None) -> Parallel:
    """Multi-host init (if configured), mesh and rules of `cfg.mesh`.

    Raises:
      sharding.mesh.MeshError / sharding.rules.ShardingRuleError: sizes that do not fit the
        devices, or a mesh axis the preset does not use.
      ConfigError: the global batch does not split over the batch axes or the processes, or
        model.moe_impl=pallas gets fewer routed rows per device than its kernel takes.
    """
    sdist.initialize_from_config(cfg.distributed)
    _prefix_secondary_logs()
    mesh = make_mesh(cfg.mesh, devices)
    rules = shr.get_rules(cfg.mesh.preset)
    rules.check_mesh(mesh)
    par = Parallel(mesh, rules, shr.ShardingContext(mesh, rules, striped=cfg.mesh.cp_layout == "striped"))
    n_batch = int(np.prod([mesh.shape[a] for a in rules.mesh_axes("batch", mesh)]))
    if cfg.data.batch_size % n_batch:
        if mesh.shape["expert"] > 1 or mesh.shape["context"] > 1 or jax.process_count() > 1:
            raise C.ConfigError(f"config: data.batch_size={cfg.data.batch_size} is not divisible by the "
                                f"{n_batch} batch shards of mesh {dict(mesh.shape)} (preset {rules.name})")
        log.warning("data.batch_size=%d does not split over %d batch shards: the batch is partly "
                    "replicated (parameters stay sharded)", cfg.data.batch_size, n_batch)
    if cfg.data.batch_size % jax.process_count():
        raise C.ConfigError(f"config: data.batch_size={cfg.data.batch_size} is not divisible by "
                            f"{jax.process_count()} processes")
    if mesh.size > 1:  # the routed experts' rows per device, as `moe_from_context` splits them
        d = cfg.data
        spec = par.ctx.spec(("batch", "seq", None), (d.batch_size, d.seq_len, cfg.model.hidden_size),
                            strict=False)
        axes = [a for e in spec[:2] if e is not None for a in ((e,) if isinstance(e, str) else e)]
        check_moe_kernel_rows(cfg, int(np.prod([mesh.shape[a] for a in axes])),
                              mesh.shape["expert"], str(dict(mesh.shape)))
    return par


def state_shardings(fns, tx, par: Parallel, abstract_state: dict) -> dict:
    """NamedShardings of the whole train state under `par`'s rules (ZeRO-3 for params and
    moments, replicated scalars; router biases by their logical axes)."""
    p_logical = nnx.get_partition_spec(fns.abstract_params).to_pure_dict()
    r_logical = nnx.get_partition_spec(fns.abstract_rest).to_pure_dict()
    sel = finetune.select_like
    p_sh = shr.tree_shardings(sel(p_logical, abstract_state["params"]), abstract_state["params"], par.mesh,
                              par.rules)
    r_sh = shr.tree_shardings(r_logical, abstract_state["rest"], par.mesh, par.rules, param=False)
    rep = NamedSharding(par.mesh, P())
    out = {k: rep for k in abstract_state}
    out["params"], out["rest"] = p_sh, r_sh
    if "frozen" in abstract_state:  # frozen weights: sharded as parameters, no moments
        out["frozen"] = shr.tree_shardings(sel(p_logical, abstract_state["frozen"]), abstract_state["frozen"],
                                           par.mesh, par.rules)
    out["opt"] = shr.optimizer_shardings(tx, abstract_state["opt"], p_sh, par.mesh)
    if COPY_KEY in abstract_state:  # the compute-dtype copy: sharded as the params it casts;
        # stored FP8 copies (one device only, `fp8_copy_paths`) replicated
        def copy_sharding(c, s):
            if isinstance(c, Fp8Copy):
                return jax.tree.map(lambda _: rep, c)
            return None if c is None else s
        out[COPY_KEY] = jax.tree.map(copy_sharding, abstract_state[COPY_KEY], p_sh,
                                     is_leaf=is_copy_leaf)
    return out


def fp8_copy_paths(fns, par: Parallel) -> frozenset[tuple[str, ...]]:
    """The params whose compute copy in the train state is their stored E4M3 copy (`init_state`'s
    fp8_paths): every weight an FP8 GEMM consumes (`ModelFns.fp8_weight_paths`) where it enters
    the GEMM whole, i.e. on one device. Under a mesh of several devices the FP8 GEMMs run inside
    `shard_map` on each device's gathered or split weight (`sharding.fp8_linear`,
    `sharding.expert_parallel`), which quantises it there: those weights keep the compute-dtype
    copy (empty set)."""
    return fns.fp8_weight_paths() if par.mesh.size == 1 else frozenset()


def create_state(fns, params, rest, tx, par: Parallel, loss_scale: float = 1.0, frozen=None,
                 compute_dtype=None):
    """Place params/rest (and the frozen leaves, if any) and build the optimizer state of
    `params` in their shardings; `compute_dtype` as in `init_state` (the training loop passes
    `model.dtype`, so fp32 master weights keep their compute-dtype copy in the state, the
    weights of the FP8 GEMMs as their stored E4M3 copy where `fp8_copy_paths` says so).

    The placed params, rest and frozen leaves become the state's own arrays, not copies (a copy
    would hold the params twice while the optimizer state and the compute copy are built, above
    the train step's own peak with fp32 master weights), so the caller's arrays must not be used
    after the first (donating) train step.

    Returns (state, shardings)."""
    fp8 = fp8_copy_paths(fns, par)
    init = lambda p, r, f: init_state(p, r, tx, loss_scale, frozen=f, compute_dtype=compute_dtype,  # noqa: E731
                                      fp8_paths=fp8)
    abstract = jax.eval_shape(init, params, rest, frozen)
    sh = state_shardings(fns, tx, par, abstract)
    placed = {"params": jax.device_put(params, sh["params"]), "rest": jax.device_put(rest, sh["rest"])}
    if frozen is not None:
        placed["frozen"] = jax.device_put(frozen, sh["frozen"])
    built = lambda p, r, f: {k: v for k, v in init(p, r, f).items() if k not in placed}  # noqa: E731
    state = jax.jit(built, out_shardings={k: v for k, v in sh.items() if k not in placed})(
        placed["params"], placed["rest"], placed.get("frozen"))
    return {**state, **placed}, sh


def restore_state(ckpt: Checkpointer, state: dict, shardings: dict, step: int, compute_dtype):
    """`ckpt`'s checkpoint `step` (verified) restored into the layout of `state`, with the
    compute-dtype copy (which checkpoints leave out) cast again from the restored params (its
    stored FP8 copies quantised again).

    Returns (state, data_state, step)."""
    restored, data_state, _, start = ckpt.restore(abstract_like(checkpointed(state)), step, verified=True)
    if COPY_KEY in state:
        fp8 = copied_fp8_paths(state[COPY_KEY])
        restored[COPY_KEY] = jax.jit(lambda p: compute_copy(p, compute_dtype, fp8),
                                     out_shardings=shardings[COPY_KEY])(restored["params"])
    return restored, data_state, start


def global_batch(par: Parallel, local: dict, accum: int | None = None) -> dict:
    """This process's rows ([rows, T] numpy) -> global [A, B, T] (or [B, T] if accum is None)
    jax.Arrays, with the sequence striped over `context` when ring attention is load-balanced."""
    out = {}
    P_ = jax.process_count()
    for k, v in local.items():
        v = np.asarray(v)
        if accum is not None:
            v = v.reshape(accum, v.shape[0] // accum, *v.shape[1:])
        v = stripe(v, par.cp, axis=v.ndim - 1)
        gshape = list(v.shape)
        gshape[-2] *= P_
        sh = par.batch_sharding(v.ndim, tuple(gshape))
        out[k] = jax.make_array_from_process_local_data(sh, v, tuple(gshape))
    return out


def jit_train_step(cfg: C.Config, fns, tx, schedule, par: Parallel, shardings: dict):
    """The train step jitted with state/batch shardings, donated state and replicated metrics,
    traced under the sharding context (ring attention, EP, activation constraints)."""
    step = make_train_step(cfg, fns, tx, schedule, platform=par.mesh.devices.flat[0].platform)

    def traced(state, batch):
        with shr.use_sharding(par.ctx):
            return step(state, batch)

    return jax.jit(traced, in_shardings=(shardings, None),
                   out_shardings=(shardings, NamedSharding(par.mesh, P())), donate_argnums=0)


def jit_eval_step(cfg: C.Config, fns, par: Parallel, shardings: dict):
    step = make_eval_step(cfg, fns)

    def traced(params, rest, batch):
        with shr.use_sharding(par.ctx):
            return step(params, rest, batch)

    p_sh = finetune.join(shardings["params"], shardings.get("frozen"))
    return jax.jit(traced, in_shardings=(p_sh, shardings["rest"], None),
                   out_shardings=NamedSharding(par.mesh, P()))


def build_data(cfg: C.Config, run_tokenizer: Path | None = None):
    """Tokenizer, training loader and validation loader for `cfg.data`.

    run_tokenizer: the tokenizer.json of the run being resumed; it is used as is (the saved
      weights belong to it), and a data.tokenizer with other contents is an error.
    Returns (tok, train_loader, val_loader or None). The training loader yields
    batch_size * grad_accum rows per step.
    Raises FileNotFoundError (a missing source) or ConfigError before any tokenizer training.
    """
    d = cfg.data
    if d.format == "chat":  # conversations rendered with the checkpoint's tokenizer and template
        if run_tokenizer is not None and Path(d.tokenizer).read_bytes() != run_tokenizer.read_bytes():
            raise C.ConfigError(f"config: data.tokenizer={d.tokenizer} differs from the tokenizer of the "
                                f"run being resumed ({run_tokenizer})")
        tok, train, val = chat.loaders_from_config(d, d.batch_size * cfg.train.grad_accum,
                                                   jax.process_index(), jax.process_count())
        if tok.vocab_size > cfg.model.vocab_size:
            raise C.ConfigError(f"config: model.vocab_size={cfg.model.vocab_size} is smaller than the "
                                f"tokenizer's {tok.vocab_size} tokens ({tok.path})")
        return tok, train, val
    if d.train == ["stdlib"]:
        files = stdlib_files()
        train_files, val_files = split_files(files, d.val_fraction, d.seed)
    else:
        files = expand_sources(d.train, "data.train")
        if d.validation:
            train_files, val_files = files, expand_sources(d.validation, "data.validation")
        elif d.val_fraction > 0 and len(files) > 1:
            train_files, val_files = split_files(files, d.val_fraction, d.seed)
        else:
            train_files, val_files = files, []
    vocab = d.tokenizer_vocab_size or cfg.model.vocab_size
    tok_file = d.tokenizer
    if run_tokenizer is not None:
        if d.tokenizer is not None and Path(d.tokenizer).is_file() and \
                Path(d.tokenizer).read_bytes() != run_tokenizer.read_bytes():
            raise C.ConfigError(f"config: data.tokenizer={d.tokenizer} differs from the tokenizer of the "
                                f"run being resumed ({run_tokenizer})")
        tok_file = run_tokenizer
    elif tok_file is None and vocab < MIN_BPE_VOCAB:
        raise C.ConfigError(f"config: the byte-level BPE trained for this run needs a vocabulary of at "
                            f"least {MIN_BPE_VOCAB} (256 bytes and 2 special tokens): "
                            f"model.vocab_size / data.tokenizer_vocab_size is {vocab}")
    cache = Path(d.cache_dir).expanduser()
    train_docs = Documents(train_files, d.text_field)
    tok = load_or_train(cache, vocab, train_docs, tok_file)
    if tok.vocab_size > cfg.model.vocab_size:
        raise C.ConfigError(f"config: model.vocab_size={cfg.model.vocab_size} is smaller than the "
                            f"tokenizer's {tok.vocab_size} tokens ({tok.path})")
    rows = d.batch_size * cfg.train.grad_accum
    pi, pc = jax.process_index(), jax.process_count()
    train = PackedLoader(train_docs, tok, rows, d.seq_len, d.seed, process_index=pi, process_count=pc)
    val = None
    if val_files:
        val = PackedLoader(Documents(val_files, d.text_field), tok, d.batch_size, d.seq_len,
                           d.seed, shuffle=False, process_index=pi, process_count=pc)
    return tok, train, val


def evaluate(eval_step, params, rest, val: PackedLoader, max_batches: int, par: Parallel) -> float:
    """Mean fp32 cross-entropy per real target token over (at most) max_batches batches."""
    nll, n = 0.0, 0.0
    for batch in val.iter_epoch_once(max_batches=max_batches):
        s, c = eval_step(params, rest, global_batch(par, batch))
        nll += float(s)
        n += float(c)
    return nll / max(n, 1.0)


def move_aside(step_dir: Path, aside_root: Path) -> Path:
    """Move step_dir into aside_root under its own name, or NAME.1, NAME.2, ... if a step of
    that name was moved aside before (a step number is reused when a run continues from an
    older checkpoint); returns the new path. Raises OSError if the move fails."""
    aside_root.mkdir(parents=True, exist_ok=True)
    dest, n = aside_root / step_dir.name, 0
    while dest.exists():
        n += 1
        dest = aside_root / f"{step_dir.name}.{n}"
    shutil.move(str(step_dir), str(dest))
    return dest


def nonfinite_advice(cfg: C.Config) -> str:
    """What to change after non-finite gradients stopped a run, for its model.dtype: fp16
    (loss-scaled, every such step skipped) can move to bfloat16's wider range; bfloat16 and
    float32 already have it, so the learning rate, the data or skipping are what is left."""
    tc = cfg.train
    if cfg.model.dtype == "float16":
        return ("lower optim.learning_rate, or use model.dtype=bfloat16 (float32's exponent range, "
                "no loss scaling)")
    skip = (f"or raise train.max_skipped_steps={tc.max_skipped_steps} to skip more steps in a row"
            if tc.skip_nonfinite else
            f"or set train.skip_nonfinite=true to skip such steps (at most train.max_skipped_steps="
            f"{tc.max_skipped_steps} in a row)")
    return (f"lower optim.learning_rate (now {cfg.optim.learning_rate:g}) or raise optim.warmup_steps, "
            f"check the training data of those steps, {skip}")


def check_aside(ckpt_dir: Path, aside_root: Path, steps) -> None:
    """--resume-from-intact, before anything is written: the damaged `steps` of ckpt_dir can be
    moved into aside_root (a directory or absent, in a writable place).

    Raises:
      FileExistsError: aside_root exists and is not a directory.
      ValueError: ckpt_dir, aside_root or (aside_root absent) its parent is not writable.
    """
    what = (f"the damaged checkpoint step{'s' if len(steps) > 1 else ''} "
            f"{', '.join(str(s) for s in sorted(steps))} cannot be moved there")
    if aside_root.exists() and not aside_root.is_dir():
        raise FileExistsError(f"--resume-from-intact: {aside_root} exists and is not a directory: {what} "
                              f"(move or remove it)")
    for d in (ckpt_dir, aside_root if aside_root.exists() else aside_root.parent):
        if not os.access(d, os.W_OK | os.X_OK):
            raise ValueError(f"--resume-from-intact: {d} is not writable: {what}")


def train(cfg: C.Config, resume: bool = False, from_intact: bool = False) -> dict:
    """Train per `cfg`; returns a summary dict: val_loss and train_loss {step: loss}, steps,
    wall_s (the whole call), first_step_s (the first step, mostly compilation), and
    tokens_per_s / train_s: the run's average target tokens per second over train_s, the
    training-loop time after the first step without evaluations (absent if no step ran).

    Every input (data sources, tokenizer, and on resume the checkpoint's checksums, state and
    loader position) is checked before anything in RUN_DIR is written; a resumed run keeps its
    tokenizer.json. `from_intact` (implies resume): if the newest checkpoint is damaged, continue
    from the newest intact one and move the damaged steps to RUN_DIR/checkpoints-damaged/.

    Raises:
      FileExistsError: RUN_DIR already holds checkpoints and `resume` is False, or (`from_intact`,
        a damaged step) RUN_DIR/checkpoints-damaged is not a directory.
      ValueError: (`from_intact`, a damaged step) the damaged step cannot be moved aside.
      CheckpointError: a checkpoint is damaged (without `from_intact`) or a save failed.
      NonFiniteError: non-finite gradients under bf16/fp32 without train.skip_nonfinite,
        train.max_skipped_steps consecutive skipped steps, or a non-finite validation loss.
      SystemExit(143): after saving a checkpoint on SIGTERM.
    """
    t0 = time.time()
    tc = cfg.train
    resume = resume or from_intact
    par = setup_parallel(cfg)
    primary = jax.process_index() == 0  # writes RUN_DIR's files other than orbax's checkpoints
    run_dir = Path(tc.run_dir)
    ckpt_dir = run_dir / "checkpoints"
    if run_dir.exists() and not run_dir.is_dir():
        raise FileExistsError(f"train.run_dir {run_dir} exists and is not a directory")
    old = Checkpointer(ckpt_dir, read_only=True) if ckpt_dir.is_dir() else None
    latest = old.latest_step() if old is not None else None
    if latest is not None and not resume:
        raise FileExistsError(f"train.run_dir {run_dir} already holds checkpoints "
                              f"(step {latest}): pass --resume, or choose another run_dir")
    check_paths(cfg, new_run=latest is None)  # each missing input named by its field
    run_tok = run_dir / "tokenizer.json"
    tok, train_loader, val_loader = build_data(cfg, run_tok if latest is not None and run_tok.is_file() else None)

    fns, params, rest = init_model(cfg)
    # base weights from a checkpoint, adapters fresh; not on resume: the run's own checkpoint
    # holds every weight (trainable in `params`, frozen in `frozen`), so the base may be gone
    if (tc.init_from_hf or tc.init_from) and latest is None:
        base, adapters = finetune.base_and_adapters(params)
        if tc.init_from_hf:  # frozen FP8 weights stay FP8 under model.fp8=blockwise
            base, rest = load_hf_params(tc.init_from_hf, cfg.model, base, rest,
                                        fp8_keep=finetune.fp8_frozen_paths(cfg, params))
        else:
            base, rest = runs.load_base_run(tc.init_from, cfg)
        params = finetune.join(base, adapters)
    tx, schedule = build_optimizer(cfg.optim, tc.steps)
    params, frozen = finetune.partition(cfg, params)
    state, shardings = create_state(fns, params, rest, tx, par, initial_loss_scale(cfg), frozen or None,
                                    compute_dtype=jnp.dtype(cfg.model.dtype))
    del params, rest, frozen
    start, damaged = 0, {}
    if latest is not None:
        step_to, damaged = old.check_restorable(from_intact=from_intact)
        if damaged:  # every process, so that all stop here alike (the checkpoints are shared)
            check_aside(ckpt_dir, run_dir / "checkpoints-damaged", damaged)
        for s_bad, problem in sorted(damaged.items()):
            log.warning("checkpoint step %d is damaged (%s): --resume-from-intact continues from step %d",
                        s_bad, problem, step_to)
        # restores into this run's shardings, whatever mesh wrote the checkpoint
        state, data_state, start = restore_state(old, state, shardings, step_to, jnp.dtype(cfg.model.dtype))
        if data_state:
            train_loader.restore(data_state)
        else:  # e.g. a run written by `dsjax.convert --from-hf`: weights only
            log.warning("checkpoint step %d holds no data-loader position: data starts from the "
                        "beginning of the corpus", start)
        log.info("resumed from step %d on mesh %s", start, dict(par.mesh.shape))
        if start >= tc.steps:
            log.warning("--resume: the checkpoint is at step %d and train.steps is %d: nothing "
                        "to train (raise train.steps to continue)", start, tc.steps)
    elif resume:  # the same command can restart a preemptible job, so this is not an error
        log.warning("--resume: no checkpoint in %s yet: starting from step 0", ckpt_dir)
    if old is not None:
        old.close()

    # every input is checked: from here on the run directory is written (by process 0)
    sync = damaged and jax.process_count() > 1  # the other processes never see a half-moved step
    if sync:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("dsjax.train: checkpoints verified")
    if primary:
        run_dir.mkdir(parents=True, exist_ok=True)
        for s_bad in sorted(damaged):
            aside_root = run_dir / "checkpoints-damaged"
            try:
                aside = move_aside(ckpt_dir / str(s_bad), aside_root)
            except OSError as e:  # what check_aside cannot see (run as root, a read-only mount)
                raise ValueError(f"--resume-from-intact: moving the damaged checkpoint step {s_bad} "
                                 f"({ckpt_dir / str(s_bad)}) into {aside_root} failed: "
                                 f"{e.strerror or e}") from None
            log.warning("moved damaged checkpoint step %d to %s", s_bad, aside)
        (run_dir / "config.yaml").write_text(C.dump_yaml(cfg))
        if Path(tok.path).resolve() != run_tok.resolve():
            shutil.copyfile(tok.path, run_tok)
        tok_config = Path(tok.path).parent / "tokenizer_config.json"  # chat template, special tokens
        if cfg.data.format == "chat" and tok_config.is_file() and \
                tok_config.resolve() != (run_dir / tok_config.name).resolve():
            shutil.copyfile(tok_config, run_dir / tok_config.name)
    if sync:
        multihost_utils.sync_global_devices("dsjax.train: damaged checkpoints moved")
    ckpt = Checkpointer(ckpt_dir, cfg.checkpoint)

    train_step = jit_train_step(cfg, fns, tx, schedule, par, shardings)
    eval_step = jit_eval_step(cfg, fns, par, shardings)
    writer = MetricsWriter(run_dir, tc.tensorboard, primary, start_step=start)
    ftok = flops_per_token(cfg.model, cfg.data.seq_len)
    peak = device_peak_flops(cfg.model.dtype, tc.peak_tflops)
    n_dev = jax.device_count()
    cfg_dict = C.to_dict(cfg)

    stop = {"sigterm": False}
    prev = signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("sigterm", True))

    bar = None
    if tc.progress and primary:
        from tqdm import tqdm

        bar = tqdm(total=tc.steps, initial=start, desc="train", dynamic_ncols=True)

    def say(msg: str) -> None:
        if not primary:
            return
        line = f"{time.strftime('%H:%M:%S')} dsjax.train: {msg}"
        (bar.write(line) if bar is not None else print(line, flush=True))

    def check_nonfinite() -> None:
        """Stop (bf16/fp32 without skip_nonfinite) once a step had non-finite gradients; the
        train step applied no update from that step on, so the state is the last good one.
        Where such steps are skipped instead (fp16 loss scaling, train.skip_nonfinite), stop
        once train.max_skipped_steps consecutive steps were skipped."""
        if cfg.model.dtype == "float16" or tc.skip_nonfinite:
            bad = int(jax.device_get(state["bad_steps"]))
            if bad >= tc.max_skipped_steps:
                first = step - bad + 1
                scale = float(jax.device_get(state["loss_scale"]))
                raise NonFiniteError(
                    f"non-finite gradients in {bad} consecutive steps ({first} to {step}): "
                    f"train.max_skipped_steps={tc.max_skipped_steps} reached at step "
                    f"{first + tc.max_skipped_steps - 1}"
                    f"{f' (loss scale now {scale:.3g})' if cfg.model.dtype == 'float16' else ''}; "
                    f"{nonfinite_advice(cfg)}")
            return
        nf = int(jax.device_get(state["nonfinite_step"]))
        if nf >= 0:
            raise NonFiniteError(f"non-finite gradients at step {nf + 1}: no update was applied from "
                                 f"then on; {nonfinite_advice(cfg)}")

    summary = {"val_loss": {}, "train_loss": {}}

    def check_val(at: int, v: float) -> None:
        if not np.isfinite(v):
            raise NonFiniteError(f"validation loss is {v} at step {at}: the parameters are not "
                                 f"finite or the model overflows in {cfg.model.dtype}")

    pending = None
    step = start
    # the run's average tokens/s counts the steps after the first (whose time is mostly XLA
    # compilation) over the loop's wall time from the end of the first step to the end of the
    # last, less the evaluations in it; checkpoint saves count (the final wait for an async save
    # does not). Tokens are summed on device, so no step waits for its metrics.
    steady_t0, steady_tokens, first_tokens, eval_s = None, None, None, 0.0
    try:  # from the first evaluation on, any error still closes the writers and the checkpointer
        if val_loader is not None and start == 0:
            v = evaluate(eval_step, finetune.full_params(state), state["rest"], val_loader, tc.eval_batches, par)
            check_val(0, v)
            summary["val_loss"][0] = v
            writer.write(0, {"val_loss": v, "elapsed_s": time.time() - t0})
            say(f"step 0 val_loss {v:.4f}")
        last_t, last_step = time.time(), start
        for step in range(start + 1, tc.steps + 1):
            batch = global_batch(par, next(train_loader), tc.grad_accum)
            state, metrics = train_step(state, batch)
            pending = metrics
            ckpt.poll()  # a failed background save stops the run here, within one step
            if step == start + 1:  # the first step compiles: keep it out of tokens/s
                jax.block_until_ready(metrics)
                summary["first_step_s"] = time.time() - last_t
                last_t, last_step = time.time(), step
                steady_t0, first_tokens = last_t, metrics["tokens"]
            else:
                steady_tokens = metrics["tokens"] if steady_tokens is None else steady_tokens + metrics["tokens"]
            if bar is not None:
                bar.update(1)
            last_of_run = step == tc.steps
            if step % tc.log_every == 0 or last_of_run or stop["sigterm"]:
                m = jax.device_get(metrics)
                now = time.time()
                if step == last_step:  # only the first (compiling) step so far
                    tps = float(m["tokens"]) / max(summary["first_step_s"], 1e-9)
                else:
                    tps = float(m["tokens"]) * (step - last_step) / max(now - last_t, 1e-9)
                    last_t, last_step = now, step
                rec = {"elapsed_s": now - t0, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
                       "tokens_per_s": tps, "loss_scale": m["loss_scale"], "skipped": m["skipped"]}
                if peak:
                    rec["mfu"] = tps * ftok / (peak * n_dev)
                rec.update({k: v for k, v in m.items() if k.startswith("grad_norm/") or k.startswith("tokens_")})
                if "expert_load_max_over_mean" in m:
                    rec["expert_load_max_over_mean"] = list(m["expert_load_max_over_mean"])
                    rec["router_entropy"] = list(m["router_entropy"])
                writer.write(step, rec)
                summary["train_loss"][step] = float(m["loss"])
                if bar is not None:
                    bar.set_postfix(loss=f"{float(m['loss']):.3f}", lr=f"{float(m['lr']):.2e}",
                                    tok_s=f"{tps:,.0f}")
                check_nonfinite()
            if val_loader is not None and (step % tc.eval_every == 0 or last_of_run):
                te = time.time()
                v = evaluate(eval_step, finetune.full_params(state), state["rest"], val_loader, tc.eval_batches, par)
                eval_s += time.time() - te
                summary["val_loss"][step] = v
                writer.write(step, {"val_loss": v, "elapsed_s": time.time() - t0})
                say(f"step {step} val_loss {v:.4f}")
                check_nonfinite()
                check_val(step, v)
            if step % cfg.checkpoint.every == 0 or last_of_run or stop["sigterm"]:
                check_nonfinite()  # never checkpoint past a halted step
                ckpt.save(step, checkpointed(state), train_loader.state(), cfg_dict)
            if stop["sigterm"]:
                ckpt.wait()
                say(f"SIGTERM: saved checkpoint at step {step} in {ckpt.directory}; exiting")
                raise SystemExit(SIGTERM_EXIT)
        loop_end = time.time()  # the last step's metrics were fetched: its work is done
        ckpt.wait()
    finally:
        signal.signal(signal.SIGTERM, prev)
        if bar is not None:
            bar.close()
        writer.close()
        ckpt.close()
    del pending
    if steady_tokens is not None:
        summary["train_s"] = loop_end - steady_t0 - eval_s
        summary["tokens_per_s"] = float(steady_tokens) / max(summary["train_s"], 1e-9)
    elif steady_t0 is not None:  # a single step: its time includes the compilation
        summary["train_s"] = summary["first_step_s"]
        summary["tokens_per_s"] = float(first_tokens) / max(summary["first_step_s"], 1e-9)
    summary["steps"] = step
    summary["wall_s"] = time.time() - t0
    summary["run_dir"] = str(run_dir)
    return summary
