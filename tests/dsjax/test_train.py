"""Training loop: loss falls, exact resume, loss scaling and non-finite handling, accumulation,
optimizer schedule and decay mask."""
import functools
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax  # noqa: F401
from dsjax import config as C
from dsjax.checkpoint import Checkpointer, abstract_like
from dsjax.data import stdlib_files
from dsjax.train import loop
from dsjax.train.optim import build_optimizer, build_schedule, decay_mask
from dsjax.train.step import (COPY_KEY, checkpointed, compute_copy, init_model, init_state, initial_loss_scale,
                              make_train_step)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    files = [f for f in stdlib_files() if f.name in {"textwrap.py", "bisect.py", "heapq.py", "fnmatch.py",
                                                      "shlex.py", "colorsys.py", "queue.py", "glob.py"}]
    for f in files:
        shutil.copy(f, d / f.name)
    return d


def cfg_for(corpus, tmp_path, *extra):
    sets = [f"data.train=[{corpus}/*.py]", "data.validation=[]", "data.val_fraction=0.25",
            f"data.cache_dir={tmp_path}/cache", "data.seq_len=64", "data.batch_size=8",
            "model.vocab_size=512", "optim.warmup_steps=5", "optim.learning_rate=3e-3",
            f"train.run_dir={tmp_path}/run", "train.progress=false", "train.tensorboard=false",
            "train.log_every=1", "train.eval_every=1000", "train.eval_batches=2"]
    return C.load(ROOT / "configs" / "tiny.yaml", sets + list(extra))


def read_metrics(run_dir):
    recs = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}, [r for r in recs if "val_loss" in r]


def test_tiny_config_loss_falls_over_30_steps(corpus, tmp_path):
    cfg = cfg_for(corpus, tmp_path, "train.steps=30")
    summary = loop.train(cfg)
    losses, vals = read_metrics(cfg.train.run_dir)
    first, last = np.mean([losses[s] for s in (1, 2, 3)]), np.mean([losses[s] for s in (28, 29, 30)])
    assert last < first - 0.3, (first, last)
    assert vals[-1]["val_loss"] < vals[0]["val_loss"] - 0.3
    assert summary["steps"] == 30
    rec = json.loads((Path(cfg.train.run_dir) / "metrics.jsonl").read_text().splitlines()[-2])
    assert {"lr", "grad_norm", "tokens_per_s", "expert_load_max_over_mean", "router_entropy",
            "loss_scale", "skipped"} <= set(rec)
    assert len(rec["expert_load_max_over_mean"]) == cfg.model.num_moe_layers
    assert (Path(cfg.train.run_dir) / "tokenizer.json").is_file()


# optim.decay_steps=30: the learning-rate schedule of the 30-step run above whatever train.steps,
# so that runs of this model share its train step program (conftest.py's compilation cache)
SCHEDULE_30 = "optim.decay_steps=30"


# bf16 compute over fp32 master weights with every linear's GEMMs in FP8 (model.fp8=blockwise): the
# state holds the weights' bf16 copy, which checkpoints leave out and a resumed run casts again; the
# E4M3 operands are quantised from the weights every step (nothing FP8 is checkpointed)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16 fp8"])
def test_resume_gives_bit_identical_losses_and_params(corpus, tmp_path, caplog, dtype):
    dtype, *fp8 = dtype.split()
    sets = ("train.steps=6", "checkpoint.every=3", SCHEDULE_30, f"model.dtype={dtype}") + (
        ("model.fp8=blockwise",) if fp8 else ())
    a = cfg_for(corpus, tmp_path / "a", *sets)
    with caplog.at_level("WARNING", logger="dsjax"):
        loop.train(a, resume=True)  # nothing to resume yet: starts from step 0 and says so
    assert "no checkpoint" in caplog.text and "starting from step 0" in caplog.text
    # B: the same run interrupted after step 3 (only checkpoint 3 survives), then resumed
    b_dir = tmp_path / "b" / "run"
    (b_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "run" / "checkpoints" / "3", b_dir / "checkpoints" / "3")
    b = cfg_for(corpus, tmp_path / "b", *sets)
    with pytest.raises(FileExistsError, match="--resume"):
        loop.train(b)
    loop.train(b, resume=True)
    la, _ = read_metrics(a.train.run_dir)
    lb, _ = read_metrics(b.train.run_dir)
    assert sorted(lb) == [4, 5, 6]
    for s in (4, 5, 6):
        assert la[s] == lb[s], (s, la[s], lb[s])
    # final states identical too, router biases (outside the optimizer) included
    fns, p, r = init_model(a)
    tx, _ = build_optimizer(a.optim, 6)
    abstract = abstract_like(init_state(p, r, tx))
    sa = Checkpointer(Path(a.train.run_dir) / "checkpoints", read_only=True).restore(abstract)
    sb = Checkpointer(b_dir / "checkpoints", read_only=True).restore(abstract)
    assert sa[3] == sb[3] == 6 and sa[1] == sb[1]
    for x, y in zip(jax.tree.leaves(sa[0]), jax.tree.leaves(sb[0])):
        np.testing.assert_array_equal(x, y)
    bias = sa[0]["rest"]["moe_layers"]["mlp"]["e_score_correction_bias"]
    assert float(jnp.abs(bias).sum()) > 0
    caplog.clear()
    with caplog.at_level("WARNING", logger="dsjax"):  # resuming a finished run says so
        assert loop.train(a, resume=True)["steps"] == 6  # the step it stands at
    assert "nothing to train" in caplog.text


def _batch(cfg, seed, accum, nan_at=None):
    B, T = cfg.data.batch_size, cfg.data.seq_len
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, cfg.model.vocab_size, size=(accum, B // accum if accum > 1 else B, T + 1))
    mask = np.ones(toks[..., 1:].shape, np.float32)
    if nan_at is not None:
        mask[0, 0, nan_at] = np.nan
    seg = np.ones(mask.shape, np.int32)
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), mask.shape)
    return {"inputs": jnp.asarray(toks[..., :-1], jnp.int32), "targets": jnp.asarray(toks[..., 1:], jnp.int32),
            "loss_mask": jnp.asarray(mask), "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos)}


def _small(tmp_path, *extra):
    return C.load(ROOT / "configs" / "tiny.yaml", ["data.seq_len=16", "data.batch_size=4", "model.vocab_size=256",
                                                   "model.hidden_size=32", "model.num_hidden_layers=2",
                                                   f"train.run_dir={tmp_path}/run", *extra])


def test_fp16_nonfinite_step_is_skipped_and_scale_halves(tmp_path):
    # case 7 under fp16: params and optimizer state bit-identical, scale halves, counter rises
    cfg = _small(tmp_path, "model.dtype=float16")
    fns, p, r = init_model(cfg)
    tx, sched = build_optimizer(cfg.optim, 10)
    state = init_state(p, r, tx)
    state["loss_scale"] = jnp.asarray(2.0 ** 15, jnp.float32)
    step = jax.jit(make_train_step(cfg, fns, tx, sched))
    before = jax.tree.map(np.asarray, state)
    state, m = step(state, _batch(cfg, 0, 1, nan_at=3))
    assert not bool(m["finite"])
    for k in ("params", "opt", "rest"):
        for x, y in zip(jax.tree.leaves(before[k]), jax.tree.leaves(state[k])):
            np.testing.assert_array_equal(x, y)
    assert float(state["loss_scale"]) == 2.0 ** 14 and int(state["skipped"]) == 1
    assert int(state["step"]) == 0 and int(state["nonfinite_step"]) == 0
    state, m = step(state, _batch(cfg, 1, 1))
    assert bool(m["finite"]) and int(state["step"]) == 1 and float(state["loss_scale"]) == 2.0 ** 14
    assert int(state["good_steps"]) == 1 and np.isfinite(float(m["loss"]))
    state["good_steps"] = jnp.asarray(1999, jnp.int32)
    state, _ = step(state, _batch(cfg, 2, 1))
    assert float(state["loss_scale"]) == 2.0 ** 15 and int(state["good_steps"]) == 0


def test_bf16_nonfinite_stops_naming_the_step(corpus, tmp_path, monkeypatch):
    # the loop looks at the device-side flag every log_every = 5 steps; the message names the
    # step whose gradients were non-finite (3), not the step at which it looked (5). A 2-layer
    # model and no validation set: the loop's check is the same, its programs half the size
    cfg = cfg_for(corpus, tmp_path, "train.steps=6", "model.dtype=bfloat16", "data.seq_len=32",
                  "train.log_every=5", "model.num_hidden_layers=2", "data.val_fraction=0")
    orig = loop.PackedLoader.__next__
    calls = {"n": 0}

    def poisoned(self):
        b = orig(self)
        calls["n"] += 1
        if self.shuffle and calls["n"] == 3:
            b = dict(b)
            b["loss_mask"] = b["loss_mask"].copy()
            b["loss_mask"][0, 0] = np.nan
        return b

    monkeypatch.setattr(loop.PackedLoader, "__next__", poisoned)
    with pytest.raises(loop.NonFiniteError, match="non-finite gradients at step 3") as e:
        loop.train(cfg)
    msg = str(e.value)  # advice for bf16: not "use model.dtype=bfloat16", nor a loss scale
    assert msg == ("non-finite gradients at step 3: no update was applied from then on; lower "
                   "optim.learning_rate (now 0.003) or raise optim.warmup_steps, check the training data of "
                   "those steps, or set train.skip_nonfinite=true to skip such steps (at most "
                   "train.max_skipped_steps=20 in a row)"), msg


def test_bf16_skipping_that_reaches_the_limit_advises_for_bf16(corpus, tmp_path, monkeypatch):
    # train.skip_nonfinite under bf16: every step from the 2nd on has a NaN in its loss mask, so
    # train.max_skipped_steps = 2 is reached at step 3; the advice is that of a bf16 run
    cfg = cfg_for(corpus, tmp_path, "train.steps=5", "model.dtype=bfloat16", "data.seq_len=32",
                  "model.num_hidden_layers=2", "data.val_fraction=0", "train.skip_nonfinite=true",
                  "train.max_skipped_steps=2", "optim.learning_rate=2e-3")
    orig = loop.PackedLoader.__next__
    calls = {"n": 0}

    def poisoned(self):
        b = orig(self)
        calls["n"] += 1
        if calls["n"] >= 2:
            b = dict(b)
            b["loss_mask"] = b["loss_mask"].copy()
            b["loss_mask"][0, 0] = np.nan
        return b

    monkeypatch.setattr(loop.PackedLoader, "__next__", poisoned)
    with pytest.raises(loop.NonFiniteError) as e:
        loop.train(cfg)
    msg = str(e.value)
    assert msg == ("non-finite gradients in 2 consecutive steps (2 to 3): train.max_skipped_steps=2 reached "
                   "at step 3; lower optim.learning_rate (now 0.002) or raise optim.warmup_steps, check the "
                   "training data of those steps, or raise train.max_skipped_steps=2 to skip more steps in a "
                   "row"), msg


@pytest.mark.parametrize("dtype, skip", [("float16", False), ("bfloat16", False), ("bfloat16", True),
                                         ("float32", False), ("float32", True)])
def test_nonfinite_advice_fits_the_dtype(tmp_path, dtype, skip):
    cfg = _small(tmp_path, f"model.dtype={dtype}", f"train.skip_nonfinite={str(skip).lower()}",
                 "train.max_skipped_steps=7")
    advice = loop.nonfinite_advice(cfg)
    assert "optim.learning_rate" in advice and "\n" not in advice
    if dtype == "float16":  # loss-scaled and skipping already: the wider range is the way out
        assert "use model.dtype=bfloat16" in advice and "skip_nonfinite" not in advice
        return
    assert "model.dtype" not in advice and "check the training data" in advice
    if skip:
        assert "raise train.max_skipped_steps=7" in advice and "skip_nonfinite" not in advice
    else:
        assert "set train.skip_nonfinite=true" in advice and "train.max_skipped_steps=7" in advice


def _assert_same_training_state(a, b):
    """Weights, optimizer state and router biases of two train states bit-identical."""
    for k in ("params", "opt", "rest"):
        for x, y in zip(jax.tree.leaves(a[k]), jax.tree.leaves(b[k])):
            np.testing.assert_array_equal(x, y)


def _finite_then_nonfinite(tmp_path, *extra):
    """A bf16 small model's jitted step after one finite step and then one whose loss mask holds
    a NaN: (step, cfg, the state after the finite step as numpy, state and metrics after)."""
    cfg = _small(tmp_path, "model.dtype=bfloat16", *extra)
    fns, p, r = init_model(cfg)
    tx, sched = build_optimizer(cfg.optim, 10)
    step = jax.jit(make_train_step(cfg, fns, tx, sched))
    state, _ = step(init_state(p, r, tx), _batch(cfg, 0, 1))
    good = jax.tree.map(np.asarray, state)
    state, m = step(state, _batch(cfg, 1, 1, nan_at=2))
    return step, cfg, good, state, m


def test_bf16_halts_updates_after_a_nonfinite_step(tmp_path):
    # the loop only looks every log_every steps: until then the step applies no further update
    step, cfg, good, state, m = _finite_then_nonfinite(tmp_path)
    assert not bool(m["finite"])
    state, m = step(state, _batch(cfg, 2, 1))
    assert bool(m["finite"]) and int(state["nonfinite_step"]) == 1 and int(state["step"]) == 1
    _assert_same_training_state(good, state)
    with pytest.raises(ValueError, match="grad_accum"):
        step(state, _batch(cfg, 3, 2))


def test_bf16_skip_nonfinite_skips_the_update_and_goes_on(tmp_path):
    # case 7 under bf16 with train.skip_nonfinite: the non-finite step leaves weights, moments
    # and router biases bit-identical and counts one skip; the next finite step applies
    step, cfg, good, state, m = _finite_then_nonfinite(tmp_path, "train.skip_nonfinite=true")
    assert not bool(m["finite"]) and int(state["skipped"]) == 1 and int(state["bad_steps"]) == 1
    assert int(state["step"]) == 1 and int(state["nonfinite_step"]) == 1
    _assert_same_training_state(good, state)
    state, m = step(state, _batch(cfg, 2, 1))
    assert bool(m["finite"]) and int(state["step"]) == 2 and int(state["bad_steps"]) == 0
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(good["params"]),
                                                         jax.tree.leaves(state["params"])))


def _two_docs(cfg, seed):
    """A [1, B, T] batch of two documents per row (no target across the boundary)."""
    b = {k: np.asarray(v).copy() for k, v in _batch(cfg, seed, 1).items()}
    T = cfg.data.seq_len
    b["segment_ids"][..., T // 2:] = 2
    b["positions"][..., T // 2:] -= T // 2
    b["loss_mask"][..., T // 2 - 1] = 0
    return b


def _tail_padded(b):
    """b with as many padding positions after each row (segment 0, mask 0, token 1)."""
    fill = {"inputs": 1, "targets": 1}
    return {k: np.concatenate([v, np.full_like(v, fill.get(k, 0))], axis=-1) for k, v in b.items()}


def test_padding_changes_no_mtp_router_balance(tmp_path):
    # case 4 with an MTP module: the same rows as they are and followed by padding give the same
    # losses, balance metrics and router-bias updates, the MTP block's included: its input at a
    # document's last positions is the padding, the next document's or a wrapped token, and
    # those positions do not count in its balance
    extra = ("model.num_nextn_predict_layers=1", "model.aux_loss_alpha=0.01")
    cfg = _small(tmp_path, *extra)
    cfg_p = _small(tmp_path, *extra, f"data.seq_len={2 * cfg.data.seq_len}")
    fns, p, r = init_model(cfg)
    tx, sched = build_optimizer(cfg.optim, 10)

    @jax.jit
    def mtp_counts(x):
        model = fns.merge(p, r)
        h, _ = model.hidden_states(x["inputs"][0], x["positions"][0], x["segment_ids"][0])
        return model.mtp_hidden(h, x["inputs"][0], x["positions"][0], x["segment_ids"][0])[1][0]["expert_counts"]

    b = _two_docs(cfg, 0)
    pb = _tail_padded(b)
    T = cfg.data.seq_len
    # per row, the depth-0 input is real at all but each document's last position
    assert float(jnp.sum(mtp_counts(b))) == cfg.data.batch_size * (T - 2) * cfg.model.num_experts_per_tok
    np.testing.assert_array_equal(mtp_counts(b), mtp_counts(pb))
    s1, m1 = jax.jit(make_train_step(cfg, fns, tx, sched))(init_state(p, r, tx), jax.tree.map(jnp.asarray, b))
    s2, m2 = jax.jit(make_train_step(cfg_p, fns, tx, sched))(init_state(p, r, tx), jax.tree.map(jnp.asarray, pb))
    for k in ("loss", "seq_aux", "router_entropy", "expert_load_max_over_mean", "mtp_loss"):
        np.testing.assert_allclose(m1[k], m2[k], rtol=1e-5, err_msg=k)
    mtp_bias = s1["rest"]["mtp"]["layers"]["block"]["mlp"]["e_score_correction_bias"]
    assert float(jnp.abs(mtp_bias).sum()) > 0
    for x, y in zip(jax.tree.leaves(s1["rest"]), jax.tree.leaves(s2["rest"])):
        np.testing.assert_array_equal(x, y)


# the balance loss of both accumulation tests: their steps are then the same two programs, each
# compiled once per session (conftest.py's compilation cache); the loss metric is the
# cross-entropy alone, the gradients and updates include the balance loss's
ACCUM_AUX = "model.aux_loss_alpha=0.1"


def test_grad_accumulation_matches_one_big_batch(tmp_path):
    cfg1 = _small(tmp_path, "train.grad_accum=1", ACCUM_AUX)
    cfg2 = _small(tmp_path, "train.grad_accum=2", ACCUM_AUX)
    fns, p, r = init_model(cfg1)
    tx, sched = build_optimizer(cfg1.optim, 10)
    big = _batch(cfg1, 0, 1)
    split = jax.tree.map(lambda x: x.reshape(2, x.shape[1] // 2, *x.shape[2:]), big)
    # uneven real-token counts per micro-batch: normalisation must be by the global count
    split["loss_mask"] = split["loss_mask"].at[1, :, 8:].set(0.0)
    big["loss_mask"] = split["loss_mask"].reshape(big["loss_mask"].shape)
    s1, m1 = jax.jit(make_train_step(cfg1, fns, tx, sched))(init_state(p, r, tx), big)
    s2, m2 = jax.jit(make_train_step(cfg2, fns, tx, sched))(init_state(p, r, tx), split)
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-5)
    np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-4)
    for x, y in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s2["params"])):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_grad_accumulation_with_padding_rows_matches_one_big_batch(tmp_path):
    # case 4 with accumulation: the balance loss and router metrics must not depend on which
    # micro-batch holds the padding rows (each micro-batch averages over its own real rows)
    cfg1 = _small(tmp_path, "train.grad_accum=1", ACCUM_AUX)
    cfg2 = _small(tmp_path, "train.grad_accum=2", ACCUM_AUX)
    fns, p, r = init_model(cfg1)
    tx, sched = build_optimizer(cfg1.optim, 10)
    big = _batch(cfg1, 3, 1)
    pad = np.ones(big["segment_ids"].shape, np.int32)
    pad[0, 3, :] = 0      # row 3: all padding
    pad[0, 2, 10:] = 0    # row 2: padded tail
    big["segment_ids"] = jnp.asarray(pad)
    big["loss_mask"] = jnp.asarray(pad, jnp.float32)
    step1 = jax.jit(make_train_step(cfg1, fns, tx, sched))
    step2 = jax.jit(make_train_step(cfg2, fns, tx, sched))
    s1, m1 = step1(init_state(p, r, tx), big)
    for order in ([0, 1, 2, 3], [0, 3, 1, 2], [3, 2, 1, 0]):  # padding row in either micro-batch
        rows = jax.tree.map(lambda x: x[:, jnp.asarray(order)], big)
        split = jax.tree.map(lambda x: x.reshape(2, x.shape[1] // 2, *x.shape[2:]), rows)
        s2, m2 = step2(init_state(p, r, tx), split)
        for k in ("loss", "seq_aux", "router_entropy", "expert_load_max_over_mean", "grad_norm"):
            np.testing.assert_allclose(m1[k], m2[k], rtol=2e-5, atol=1e-7, err_msg=f"{k} {order}")
        for x, y in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s2["params"])):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    assert float(jnp.sum(m1["seq_aux"])) > 0


def test_schedules_and_decay_mask(tmp_path):
    o = C.OptimConfig(learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1)
    s = build_schedule(o, 110)
    assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5)
    assert float(s(10)) == pytest.approx(1.0) and float(s(110)) == pytest.approx(0.1)
    w = build_schedule(C.OptimConfig(learning_rate=1.0, warmup_steps=0, schedule="wsd",
                                     wsd_decay_fraction=0.2, min_lr_ratio=0.0), 100)
    assert float(w(79)) == pytest.approx(1.0) and float(w(90)) == pytest.approx(0.5) and float(w(100)) == 0.0
    cfg = _small(tmp_path)
    _, p, _ = init_model(cfg)
    mask = decay_mask(p)
    assert mask["embed_tokens"] and mask["lm_head"]["kernel"]
    assert not mask["norm"]["weight"] and not mask["moe_layers"]["input_layernorm"]["weight"]
    assert mask["moe_layers"]["mlp"]["gate_proj"]


def test_sigterm_saves_and_resume_continues(corpus, tmp_path):
    import signal
    import subprocess
    import time

    run = tmp_path / "run"
    args = [sys.executable, "-m", "dsjax.train", "--config", str(ROOT / "configs" / "tiny.yaml"),
            "--set", f"data.train=[{corpus}/*.py]", "--set", f"data.cache_dir={tmp_path}/cache",
            "--set", "data.seq_len=32", "--set", "data.batch_size=4", "--set", "model.vocab_size=300",
            "--set", "model.num_hidden_layers=2", "--set", f"train.run_dir={run}",
            "--set", "train.progress=false", "--set", "train.log_every=1", "--set", "train.eval_every=100000",
            "--set", "checkpoint.every=100000", "--set", "optim.decay_steps=12"]
    # optim.decay_steps: both runs (other train.steps) have the schedule of test_reliability.py's
    # runs of this model, so their train step is a program compiled earlier in the session
    # (conftest.py's compilation cache)
    proc = subprocess.Popen(args + ["--set", "train.steps=100000"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline:
        if metrics.exists() and sum(1 for l in metrics.read_text().splitlines() if '"loss"' in l) >= 3:
            break
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    ck = Checkpointer(run / "checkpoints", read_only=True)
    saved = ck.latest_step()
    assert saved is not None and saved >= 3 and f"saved checkpoint at step {saved}" in out
    r = subprocess.run(args + ["--set", f"train.steps={saved + 2}", "--resume"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    losses, _ = read_metrics(run)
    assert max(losses) == saved + 2


def test_cli_log_lines_have_one_format():
    """Log lines of dsjax loggers under `run_main` read 'HH:MM:SS name: message', although the
    import of orbax installs Python's default root handler before run_main configures logging."""
    import os
    import re
    import subprocess
    code = ("import logging\nimport dsjax.train.__main__\nfrom dsjax.cli import run_main\n"
            "run_main('dsjax.train', lambda: logging.getLogger('dsjax.train').info('resumed from step %d', 7))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"^\d\d:\d\d:\d\d dsjax\.train: resumed from step 7$", r.stderr, re.M), r.stderr
    assert "INFO:dsjax" not in r.stderr


def test_pallas_attention_in_interpret_mode_trains_without_pjrt_nproc(corpus, tmp_path):
    """`python -m dsjax.train` with model.attention_impl=pallas on one CPU device (the kernel in
    GPU interpret mode) and no PJRT_NPROC in the environment: with XLA's default pool of one
    thread per core (2 on the test machine) the jitted step deadlocked at 0 % CPU after the run
    directory was written; the command now sizes the pool before jax starts and the run ends."""
    import os
    import subprocess
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    env["JAX_PLATFORMS"] = "cpu"
    run = tmp_path / "run"
    sets = ["model.attention_impl=pallas", "model.dtype=bfloat16", "model.qk_nope_head_dim=48",
            "model.qk_rope_head_dim=16", "model.v_head_dim=64", "model.hidden_size=64",
            "model.intermediate_size=64", "model.moe_intermediate_size=32", "model.num_hidden_layers=2",
            "model.vocab_size=300", "model.q_lora_rank=16", "model.kv_lora_rank=16", "data.seq_len=128",
            "data.batch_size=1", f"data.train=[{corpus}/*.py]", "data.val_fraction=0",
            f"data.cache_dir={tmp_path}/cache", "train.steps=2", f"train.run_dir={run}", "train.progress=false",
            "train.tensorboard=false", "train.log_every=1", "checkpoint.every=1000"]
    argv = [sys.executable, "-m", "dsjax.train", "--config", str(ROOT / "configs" / "tiny.yaml")]
    for s in sets:
        argv += ["--set", s]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'summary {"steps": 2' in r.stdout, r.stdout[-2000:]
    assert "can deadlock" not in r.stderr  # the kernels' warning about a small pool did not fire
    losses, _ = read_metrics(run)
    assert sorted(losses) == [1, 2] and all(np.isfinite(v) for v in losses.values())


@pytest.mark.parametrize("extra", [[], ["model.moe_recompute=true"], ["model.dtype=float16"]])
def test_expert_gradients_written_in_place_equal_the_stacked_ones(tmp_path, monkeypatch, extra):
    """Unrolled MoE layers on one device write their routed experts' weight gradients into the
    stacked gradient in place (`moe.expert_grad_sinks`, one uninitialised ref per projection)
    and their sums of squares for the global norm; two train steps give bitwise the params,
    moments and metrics (grad norms included) of the per-layer gradients stacked after the
    backward (the sinks switched off); under fp16 too, whose loss-scaled squares are unscaled.
    Not under model.moe_recompute."""
    import dsjax.train.step as step_mod
    cfg = _small(tmp_path, "model.num_hidden_layers=3", *extra)  # 2 MoE layers
    fns, p, r = init_model(cfg)
    tx, sched = build_optimizer(cfg.optim, 10)
    b = _batch(cfg, 0, 1)
    make = lambda: make_train_step(cfg, fns, tx, sched)  # noqa: E731
    def two_steps():
        step = jax.jit(make())
        s, _ = step(init_state(p, r, tx, initial_loss_scale(cfg)), b)  # fp16: 2^15
        return step(s, _batch(cfg, 1, 1))  # the first step's learning rate is 0 (warmup)
    sunk = "empty_ref" in str(jax.make_jaxpr(make())(init_state(p, r, tx), b))
    assert sunk == ("model.moe_recompute=true" not in extra)
    s1, m1 = two_steps()
    monkeypatch.setattr(step_mod, "EXPERT_PROJS", ())
    assert "empty_ref" not in str(jax.make_jaxpr(make())(init_state(p, r, tx), b))
    s2, m2 = two_steps()
    for k in ("params", "opt"):
        for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(s1[k])[0], jax.tree.leaves(s2[k])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
    for k in m1:
        np.testing.assert_array_equal(np.asarray(m1[k]), np.asarray(m2[k]), err_msg=k)
    for proj in ("gate_proj", "up_proj", "down_proj"):  # every layer's experts moved
        moved = np.abs(np.asarray(s1["params"]["moe_layers"]["mlp"][proj], np.float32)
                       - np.asarray(p["moe_layers"]["mlp"][proj], np.float32))
        assert moved.reshape(moved.shape[0], -1).max(axis=1).min() > 0, proj


@pytest.mark.parametrize("impl", ["reference", "mosaic"])
def test_fp8_expert_gradients_written_in_place_equal_the_stacked_ones(tmp_path, monkeypatch, impl):
    """model.fp8=blockwise: the routed experts' FP8 weight gradients go to the same in-place
    sinks as the bf16 ones (`moe.expert_grad_sinks`), in the stacks' dtype (bf16 here); a train
    step gives bitwise the params and moments of the per-layer gradients stacked after the
    backward (sinks switched off), and the grad norm to fp32 rounding (the kernel sums its
    squares in its own order; no clipping, so the params do not depend on it). "mosaic": the
    grouped FP8 GEMMs on the Mosaic kernels in CPU interpret mode, at widths (128) where the
    wgrad kernel writes the sink itself; "reference": dw then a dynamic update of the sink."""
    import dsjax.train.step as step_mod
    from pallas_kernels.fp8 import api as fp8_api
    from pallas_kernels.fp8 import frozen as fp8_frozen
    sets = ["model.num_hidden_layers=3", "model.fp8=blockwise", "model.dtype=bfloat16",
            "optim.warmup_steps=0", "optim.grad_clip_norm=0"]  # 2 MoE layers
    if impl == "mosaic":
        sets += ["model.hidden_size=128", "model.moe_intermediate_size=128"]
        monkeypatch.setattr(fp8_frozen, "grouped_gemm", functools.partial(fp8_frozen.grouped_gemm, impl="mosaic"))
    cfg = _small(tmp_path, *sets)
    fns, p, r = init_model(cfg)
    tx, sched = build_optimizer(cfg.optim, 10)
    b = _batch(cfg, 0, 1)
    make = lambda: make_train_step(cfg, fns, tx, sched)  # noqa: E731
    in_place = []
    real = fp8_api.mosaic_grouped_wgrad.fp8_grouped_wgrad
    monkeypatch.setattr(fp8_api.mosaic_grouped_wgrad, "fp8_grouped_wgrad",
                        lambda *a, **kw: in_place.append(kw.get("out") is not None) or real(*a, **kw))

    def one_step():
        s, m = jax.jit(make())(init_state(p, r, tx), b)
        jax.block_until_ready(s)
        jax.effects_barrier()  # interpret mode's callbacks done before the next program
        return s, m

    s1, m1 = one_step()
    assert in_place == ([True] * 6 if impl == "mosaic" else [])  # 3 projections x 2 layers
    monkeypatch.setattr(step_mod, "EXPERT_PROJS", ())
    assert "empty_ref" not in str(jax.make_jaxpr(make())(init_state(p, r, tx), b))
    in_place.clear()
    s2, m2 = one_step()
    assert in_place == ([False] * 6 if impl == "mosaic" else [])
    for k in ("params", "opt"):
        for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(s1[k])[0], jax.tree.leaves(s2[k])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
    for k in m1:
        np.testing.assert_allclose(np.asarray(m1[k]), np.asarray(m2[k]), rtol=1e-6, err_msg=k)
    for proj in ("gate_proj", "up_proj", "down_proj"):  # every layer's experts moved
        moved = np.abs(np.asarray(s1["params"]["moe_layers"]["mlp"][proj], np.float32)
                       - np.asarray(p["moe_layers"]["mlp"][proj], np.float32))
        assert moved.reshape(moved.shape[0], -1).max(axis=1).min() > 0, proj


def test_a_new_run_moves_a_leftover_metrics_file_aside(tmp_path):
    """A run from step 0 in a directory whose earlier run left records but no checkpoint: every
    earlier record moves to metrics.superseded.jsonl (nothing is appended after them); a writer
    on a process other than 0 touches no file."""
    from dsjax.train.metrics import MetricsWriter

    w = MetricsWriter(tmp_path, tensorboard=False, primary=True)
    w.write(0, {"val_loss": 5.0})
    w.write(1, {"loss": 4.0})
    w.close()
    assert not (tmp_path / "metrics.superseded.jsonl").exists()
    w = MetricsWriter(tmp_path, tensorboard=False, primary=True, start_step=0)
    w.write(0, {"val_loss": 6.0})
    w.close()
    assert [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == \
        [{"step": 0, "val_loss": 6.0}]
    assert [json.loads(l) for l in (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()] == \
        [{"step": 0, "val_loss": 5.0}, {"step": 1, "loss": 4.0}]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    w = MetricsWriter(tmp_path, tensorboard=False, primary=False, start_step=0)  # not process 0
    assert w.file is None and (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


@pytest.mark.parametrize("round_logits", [False, True])
def test_train_and_eval_losses_agree_with_rounded_or_fp32_logits(tmp_path, round_logits):
    """The train step's fused loss and the eval step's logits + log_softmax give one loss for
    the same weights and batch, with `model.round_logits` (bf16 logits, HF's rounding) and
    without; the rounding moves the bf16 loss off the fp32-logit one."""
    from dsjax.train.step import make_eval_step
    big = "model.initializer_range=0.5"  # logits of a few units: their bf16 rounding shows in the loss
    cfg = _small(tmp_path, "model.dtype=bfloat16", big, f"model.round_logits={str(round_logits).lower()}")
    fns, p, r = init_model(cfg)
    tx, sched = build_optimizer(cfg.optim, 10)
    state = init_state(p, r, tx)
    batch = _batch(cfg, 0, 1)
    _, m = jax.jit(make_train_step(cfg, fns, tx, sched))(state, batch)
    nll, n = jax.jit(make_eval_step(cfg, fns))(p, r, jax.tree.map(lambda x: x[0], batch))
    assert abs(float(m["loss"]) - float(nll / n)) < 1e-5 * float(nll / n)
    flip = _small(tmp_path, "model.dtype=bfloat16", big, f"model.round_logits={str(not round_logits).lower()}")
    nll_flip, _ = jax.jit(make_eval_step(flip, init_model(flip)[0]))(p, r, jax.tree.map(lambda x: x[0], batch))
    assert 0 < abs(float(nll_flip - nll)) < 1e-2 * float(nll)


def test_a_step_damaged_again_moves_aside_under_a_new_name(tmp_path):
    ckpt, aside = tmp_path / "checkpoints", tmp_path / "checkpoints-damaged"
    moved = []
    for i in range(3):  # step 12 damaged, the run continued from 10 and wrote 12 again, ...
        (ckpt / "12").mkdir(parents=True)
        (ckpt / "12" / "f").write_text(str(i))
        moved.append(loop.move_aside(ckpt / "12", aside))
    assert moved == [aside / "12", aside / "12.1", aside / "12.2"]
    assert [(p / "f").read_text() for p in moved] == ["0", "1", "2"] and not (ckpt / "12").exists()


def test_the_kept_compute_copy_gives_the_state_of_casting_every_step(tmp_path):
    """bf16 compute over fp32 master weights: a state built with `compute_dtype` holds the bf16
    copy (COPY_KEY), the step reads it instead of casting and writes the next one. Params,
    moments, biases and metrics are bitwise those of the step that casts every time, over finite
    steps and a non-finite one, and the copy stays the cast of the params; the step does read it
    (a copy of zeros changes the loss), and checkpoints leave it out."""
    cfg = _small(tmp_path, "model.dtype=bfloat16")
    fns, p, r = init_model(cfg)
    tx, sched = build_optimizer(cfg.optim, 10)
    step = jax.jit(make_train_step(cfg, fns, tx, sched))
    a, b = init_state(p, r, tx), init_state(p, r, tx, compute_dtype=jnp.bfloat16)
    assert COPY_KEY not in a and COPY_KEY not in init_state(p, r, tx, compute_dtype=jnp.float32)
    n_cast = len(jax.tree.leaves(b[COPY_KEY]))
    assert 0 < n_cast < len(jax.tree.leaves(p))  # the embedding and router gates stay fp32
    zeros = dict(b, **{COPY_KEY: jax.tree.map(jnp.zeros_like, b[COPY_KEY])})
    assert float(step(zeros, _batch(cfg, 0, 1))[1]["loss"]) != float(step(b, _batch(cfg, 0, 1))[1]["loss"])
    for batch in (_batch(cfg, 0, 1), _batch(cfg, 1, 1), _batch(cfg, 2, 1, nan_at=2)):
        a, ma = step(a, batch)
        b, mb = step(b, batch)
        assert jax.tree.structure(ma) == jax.tree.structure(mb)
        for x, y in zip(jax.tree.leaves(ma), jax.tree.leaves(mb)):
            np.testing.assert_array_equal(x, y)
        _assert_same_training_state(a, b)
        cast = compute_copy(b["params"], jnp.bfloat16)
        assert len(jax.tree.leaves(b[COPY_KEY])) == n_cast
        for x, y in zip(jax.tree.leaves(cast), jax.tree.leaves(b[COPY_KEY])):
            assert y.dtype == jnp.bfloat16
            np.testing.assert_array_equal(x, y)
    assert not bool(mb["finite"]) and int(b["step"]) == 2
    assert set(checkpointed(b)) == set(a)


def test_the_gpu_update_pass_gives_the_state_of_the_split_one(tmp_path):
    """`make_train_step(platform="gpu")` updates weights and moments in one pass (XLA:GPU's
    fusion), `platform="cpu"` in two ordered by a barrier: the same state, bit for bit, including
    after a non-finite step (both keep the old state)."""
    cfg = _small(tmp_path, "model.dtype=bfloat16")
    fns, p, r = init_model(cfg)
    tx, sched = build_optimizer(cfg.optim, 10)
    out = {}
    for platform in ("gpu", "cpu"):
        step = jax.jit(make_train_step(cfg, fns, tx, sched, platform=platform))
        state, _ = step(init_state(p, r, tx), _batch(cfg, 0, 1))
        state, m = step(state, _batch(cfg, 1, 1, nan_at=2))
        out[platform] = (state, bool(m["finite"]))
    assert out["gpu"][1] is out["cpu"][1] is False
    assert int(out["gpu"][0]["step"]) == int(out["cpu"][0]["step"]) == 1
    _assert_same_training_state(out["gpu"][0], out["cpu"][0])
