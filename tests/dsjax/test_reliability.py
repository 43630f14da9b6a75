"""A run never hangs, never lies and never damages what it wrote: failed checkpoint writes
(sync and background), fp16 loss-scale policy and runaway skipping, NaN validation loss, resume
that leaves the run directory alone until every input is checked, checkpoint checksums with an
explicit fallback, and a fuzz test of malformed configs."""
import dataclasses
import errno
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import typing
from pathlib import Path

import jax
import numpy as np
import pytest
from orbax.checkpoint._src.path import async_path

import dsjax  # noqa: F401
from dsjax import config as C
from dsjax.config import checks, schema
from dsjax.checkpoint import CHECKSUMS, Checkpointer, CheckpointError, abstract_like
from dsjax.cli import run_main
from dsjax.data import stdlib_files
from dsjax.train import loop
from dsjax.train.__main__ import main as train_main
from dsjax.train.optim import build_optimizer
from dsjax.train.step import INITIAL_SCALE, init_model, init_state, initial_loss_scale

ROOT = Path(__file__).resolve().parents[2]
NAMES = {"textwrap.py", "bisect.py", "heapq.py", "fnmatch.py", "shlex.py", "colorsys.py", "queue.py", "glob.py"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for f in stdlib_files():
        if f.name in NAMES and f.parent.name != "asyncio":
            shutil.copy(f, d / f.name)
    return d


def small_sets(corpus, tmp, *extra):
    # optim.decay_steps: one learning-rate schedule whatever train.steps, so that the runs of one
    # dtype and learning rate lower to the same program (compiled once per session, conftest.py)
    return [f"data.train=[{corpus}/*.py]", "data.validation=[]", "data.val_fraction=0.25",
            f"data.cache_dir={tmp}/cache", "data.seq_len=32", "data.batch_size=4", "model.vocab_size=300",
            "model.num_hidden_layers=2", "model.first_k_dense_replace=1", "optim.decay_steps=12",
            f"train.run_dir={tmp}/run", "train.progress=false", "train.tensorboard=false", "train.log_every=1",
            "train.eval_every=1000", "train.eval_batches=1", *extra]


def small(corpus, tmp, *extra):
    return C.load(ROOT / "configs" / "tiny.yaml", small_sets(corpus, tmp, *extra))


def logged_steps(run_dir):
    recs = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r]


def snapshot(run_dir):
    """{relative path: bytes} of the run directory's files outside checkpoints/."""
    run_dir = Path(run_dir)
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in run_dir.rglob("*")
            if p.is_file() and "checkpoints" not in p.relative_to(run_dir).parts}


# ---------------------------------------------------------------------------------------------
# Failed checkpoint writes
# ---------------------------------------------------------------------------------------------

def commit_fault(monkeypatch, fail_step, kind):
    """Fault at the commit of step `fail_step` (orbax renames its temporary directory to
    checkpoints/<step>; in the background thread for an async save). kind "file": a plain file
    already sits at checkpoints/<step> (the rename is refused: FileExistsError); kind "enospc": a
    mocked writer fails with ENOSPC. Both hit root as well. Returns an Event set once it fired."""
    fired = threading.Event()
    real = async_path.rename

    async def rename(src, dst):
        if Path(str(dst)).name == str(fail_step) and Path(str(dst)).parent.name == "checkpoints":
            try:
                if kind == "enospc":
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))
                Path(str(dst)).write_text("not a checkpoint")
                return await real(src, dst)
            finally:
                fired.set()
        return await real(src, dst)

    monkeypatch.setattr(async_path, "rename", rename)
    return fired


@pytest.mark.parametrize("async_save, kind", [(True, "file"), (False, "enospc")])
def test_failed_save_stops_the_run_within_one_step(corpus, tmp_path, monkeypatch, async_save, kind):
    cfg = small(corpus, tmp_path, "train.steps=12", "checkpoint.every=2",
                f"checkpoint.async_save={str(async_save).lower()}")
    fired = commit_fault(monkeypatch, 4, kind)
    polls_after_fault = []
    real_poll = Checkpointer.poll

    def poll(self):
        # let a pending background save finish first, so that the step after the failed save's
        # start is the one that must stop (on a fast machine that is what happens anyway)
        while self._pending is not None and self.manager.is_saving_in_progress():
            time.sleep(0.01)
        late = fired.is_set()
        try:
            real_poll(self)
        finally:
            if late:
                polls_after_fault.append(late)

    monkeypatch.setattr(Checkpointer, "poll", poll)
    with pytest.raises(CheckpointError) as e:
        loop.train(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "saving step 4" in msg, msg
    assert str(Path(cfg.train.run_dir).absolute() / "checkpoints" / "4") in msg, msg
    assert ("checkpoints/4 already exists" if kind == "file" else "[Errno 28] No space left on device") in msg, msg
    assert fired.is_set()
    if async_save:  # the first step boundary after the background failure stops the run
        assert polls_after_fault == [True], polls_after_fault
    else:  # the save itself raises: no further step runs
        assert max(r["step"] for r in logged_steps(cfg.train.run_dir)) == 4
    # the last complete checkpoint is intact and restores
    ck = Checkpointer(Path(cfg.train.run_dir) / "checkpoints", read_only=True)
    assert ck.latest_step() == 2 and ck.verify(2) is None
    fns, p, r = init_model(cfg)
    tx, _ = build_optimizer(cfg.optim, cfg.train.steps)
    state, data, _, step = ck.restore(abstract_like(init_state(p, r, tx)))
    assert step == 2 and int(state["step"]) == 2 and data["cursors"]


def test_failed_background_save_cli_one_line_no_hang(corpus, tmp_path):
    # the CLI path: exit status 1, one error line, no traceback, and the process ends (a failed
    # background save used to leave orbax threads that kept the interpreter alive)
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from orbax.checkpoint._src.path import async_path\n"
        "real = async_path.rename\n"
        "async def rename(src, dst):\n"
        "    if Path(str(dst)).name == '4':\n"
        "        Path(str(dst)).write_text('x')\n"
        "    return await real(src, dst)\n"
        "async_path.rename = rename\n"
        "from dsjax.cli import run_main\n"
        "from dsjax.train.__main__ import main\n"
        "sys.argv[0] = 'dsjax.train'\n"
        "run_main('dsjax.train', main)\n")
    args = [sys.executable, str(driver), "--config", str(ROOT / "configs" / "tiny.yaml")]
    for s in small_sets(corpus, tmp_path, "train.steps=40", "checkpoint.every=2"):
        args += ["--set", s]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [l for l in r.stderr.splitlines() if "error" in l.lower()]
    assert len(errors) == 1 and errors[0].startswith("dsjax.train: error: checkpoint: saving step 4"), r.stderr
    assert "Traceback" not in r.stderr and "already exists" in errors[0]
    assert max(x["step"] for x in logged_steps(tmp_path / "run")) < 40
    assert Checkpointer(tmp_path / "run" / "checkpoints", read_only=True).latest_step() == 2


# ---------------------------------------------------------------------------------------------
# fp16 loss scaling, runaway skipping, non-finite validation loss
# ---------------------------------------------------------------------------------------------

def test_fp16_initial_scale_is_2_to_the_15(corpus, tmp_path):
    cfg = small(corpus, tmp_path, "model.dtype=float16")
    assert initial_loss_scale(cfg) == INITIAL_SCALE == 2.0 ** 15
    assert initial_loss_scale(small(corpus, tmp_path, "model.dtype=bfloat16")) == 1.0
    fns, p, r = init_model(cfg)
    tx, _ = build_optimizer(cfg.optim, 10)
    par = loop.setup_parallel(cfg)
    state, _ = loop.create_state(fns, p, r, tx, par, initial_loss_scale(cfg))
    assert float(state["loss_scale"]) == 2.0 ** 15 and int(state["bad_steps"]) == 0


def test_fp16_runaway_skipping_stops_naming_the_step(corpus, tmp_path):
    # learning rate 1e6: after the first update every fp16 forward overflows, so every later
    # step is skipped; the run must stop after train.max_skipped_steps of them, not skip forever
    cfg = small(corpus, tmp_path, "model.dtype=float16", "optim.learning_rate=1e6", "optim.warmup_steps=0",
                "train.steps=30", "train.max_skipped_steps=4", "checkpoint.every=1000")
    with pytest.raises(loop.NonFiniteError) as e:
        loop.train(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "4 consecutive steps" in msg and "reached at step" in msg, msg
    assert "(loss scale now " in msg and msg.endswith("; lower optim.learning_rate, or use model.dtype=bfloat16 "
                                                      "(float32's exponent range, no loss scaling)"), msg
    recs = logged_steps(cfg.train.run_dir)
    assert recs[0]["loss_scale"] == 2.0 ** 15  # the documented initial scale, logged at step 1
    assert recs[-1]["step"] < 30 and recs[-1]["skipped"] >= 4
    first = int(msg.split("(")[1].split(" to ")[0])
    reached = int(msg.split("reached at step ")[1].split(" ")[0])
    assert reached == first + 3 and all(r["skipped"] == 0 for r in recs if r["step"] < first)
    assert not list((Path(cfg.train.run_dir) / "checkpoints").glob("[0-9]*"))  # nothing saved past it


def test_nan_validation_loss_never_ends_a_run_normally(corpus, tmp_path, capsys):
    cfg = small(corpus, tmp_path, "model.dtype=float16", "optim.learning_rate=1e6", "optim.warmup_steps=0",
                "train.steps=3", "train.max_skipped_steps=1000", "checkpoint.every=1000")
    with pytest.raises(loop.NonFiniteError, match=r"validation loss is (nan|inf) at step 3"):
        loop.train(cfg)
    assert not list((Path(cfg.train.run_dir) / "checkpoints").glob("[0-9]*"))
    # through the CLI wrapper: one line, exit status 1

    def stop():
        raise loop.NonFiniteError("validation loss is nan at step 3: x")

    with pytest.raises(SystemExit) as ex:
        run_main("dsjax.train", stop)
    assert ex.value.code == 1
    assert capsys.readouterr().err == "dsjax.train: error: validation loss is nan at step 3: x\n"


def test_an_error_in_the_first_evaluation_closes_the_writers(corpus, tmp_path, monkeypatch):
    closed = []
    for cls in (loop.MetricsWriter, loop.Checkpointer):
        monkeypatch.setattr(cls, "close", lambda self, c=cls, f=cls.close: (closed.append(c.__name__), f(self)))

    def fail(*args, **kwargs):
        raise RuntimeError("the kernel failed")

    monkeypatch.setattr(loop, "evaluate", fail)
    with pytest.raises(RuntimeError, match="the kernel failed"):
        loop.train(small(corpus, tmp_path, "train.steps=1", "train.tensorboard=true"))
    assert closed.count("MetricsWriter") == 1 and "Checkpointer" in closed  # no tensorboardX thread left


# ---------------------------------------------------------------------------------------------
# Resume: nothing rewritten before every input is checked; checksums and --resume-from-intact
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def finished_run(corpus, tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4 (copy it before changing it)."""
    tmp = tmp_path_factory.mktemp("base")
    cfg = small(corpus, tmp, "train.steps=4", "checkpoint.every=2", "checkpoint.async_save=true")
    loop.train(cfg)
    return tmp


def copy_run(finished_run, tmp_path):
    shutil.copytree(finished_run / "run", tmp_path / "run")
    shutil.copytree(finished_run / "cache", tmp_path / "cache")
    return tmp_path / "run"


def test_checksums_written_for_every_step(finished_run):
    ck = Checkpointer(finished_run / "run" / "checkpoints", read_only=True)
    assert ck.all_steps() == [2, 4]
    for s in (2, 4):
        files = json.loads((ck.step_dir(s) / CHECKSUMS).read_text())["files"]
        assert any(k.startswith("state/") for k in files) and ck.verify(s) is None


def test_resume_with_changed_corpus_rewrites_nothing(corpus, finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path)
    before = snapshot(run)
    other = tmp_path / "other"
    other.mkdir()
    for f in sorted(corpus.iterdir())[:5]:
        shutil.copy(f, other / f.name)
    cfg = small(other, tmp_path, "train.steps=6", "checkpoint.every=2")
    with pytest.raises(ValueError, match=r"loader state mismatch on 'num_docs': .* \(the training "
                                         r"files, or the validation split drawn from them, are "
                                         r"not the checkpoint's\)$"):
        loop.train(cfg, resume=True)
    assert snapshot(run) == before  # tokenizer.json and config.yaml untouched
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="glob matches no file"):
        loop.train(small(empty, tmp_path, "train.steps=6"), resume=True)
    assert snapshot(run) == before


def test_resume_keeps_the_runs_tokenizer(corpus, finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path)
    tok = (run / "tokenizer.json").read_bytes()
    shutil.rmtree(tmp_path / "cache")  # no cached tokenizer: a fresh one would be trained
    cfg = small(corpus, tmp_path, "train.steps=5", "checkpoint.every=2")
    assert loop.train(cfg, resume=True)["steps"] == 5
    assert (run / "tokenizer.json").read_bytes() == tok
    assert not list((tmp_path / "cache").glob("bpe_*.json"))  # none was trained
    assert Checkpointer(run / "checkpoints", read_only=True).latest_step() == 5


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete_metadata"])
def test_damaged_checkpoint_named_and_fallback_only_on_request(corpus, finished_run, tmp_path, damage):
    run = copy_run(finished_run, tmp_path)
    step4 = run / "checkpoints" / "4"
    if damage == "delete_metadata":
        victim = next(p for p in (step4 / "state").rglob("_METADATA"))
        victim.unlink()
    else:
        victim = max((p for p in (step4 / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        data = bytearray(victim.read_bytes())
        if damage == "flip":
            data[len(data) // 2: len(data) // 2 + 64] = bytes(64 * [0x7F])
        else:
            data = data[: len(data) // 2]
        victim.write_bytes(bytes(data))
    before = snapshot(run)
    cfg = small(corpus, tmp_path, "train.steps=6", "checkpoint.every=2")
    with pytest.raises(CheckpointError) as e:
        loop.train(cfg, resume=True)
    msg = str(e.value)
    assert "\n" not in msg and "step 4 is damaged" in msg and str(victim) in msg, msg
    assert "--resume-from-intact restores the newest intact step (2)" in msg
    assert snapshot(run) == before and step4.is_dir()
    summary = loop.train(cfg, from_intact=True)
    assert summary["steps"] == 6
    assert [r["step"] for r in logged_steps(run)] == [1, 2, 3, 4, 5, 6]  # continued from step 2
    assert (run / "checkpoints-damaged" / "4").is_dir()
    ck = Checkpointer(run / "checkpoints", read_only=True)
    assert ck.latest_step() == 6 and ck.verify(4) is None and ck.verify(6) is None


def _damage_step_4(run):
    victim = max((p for p in (run / "checkpoints" / "4" / "state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])


def test_resume_from_intact_that_cannot_move_the_step_aside_is_one_line(corpus, finished_run, tmp_path,
                                                                        monkeypatch, capsys):
    """checkpoints-damaged a regular file, or not writable (simulated: the tests run as root, whom
    file modes do not stop): one line naming the path, exit 2, the run directory untouched."""
    run = copy_run(finished_run, tmp_path)
    _damage_step_4(run)
    aside = run / "checkpoints-damaged"
    aside.write_text("not a directory\n")
    before = snapshot(run)
    cfg = small(corpus, tmp_path, "train.steps=6", "checkpoint.every=2")

    def command():
        loop.train(cfg, from_intact=True)

    with pytest.raises(SystemExit) as ex:
        run_main("dsjax.train", command)
    err = capsys.readouterr().err
    assert ex.value.code == 2 and err == (
        f"dsjax.train: error: --resume-from-intact: {aside} exists and is not a directory: the damaged "
        f"checkpoint step 4 cannot be moved there (move or remove it)\n"), err
    assert snapshot(run) == before and (run / "checkpoints" / "4").is_dir()

    aside.unlink()
    before = snapshot(run)
    real_access = os.access
    monkeypatch.setattr(loop.os, "access", lambda p, mode: Path(p) != run and real_access(p, mode))
    with pytest.raises(SystemExit) as ex:
        run_main("dsjax.train", command)
    err = capsys.readouterr().err
    assert ex.value.code == 2 and err == (
        f"dsjax.train: error: --resume-from-intact: {run} is not writable: the damaged checkpoint step 4 "
        f"cannot be moved there\n"), err
    assert snapshot(run) == before and not aside.exists() and (run / "checkpoints" / "4").is_dir()


def test_a_failed_move_aside_is_one_line(corpus, finished_run, tmp_path, monkeypatch, capsys):
    """A move that fails although the checks passed (e.g. a read-only mount): one line, exit 2."""
    run = copy_run(finished_run, tmp_path)
    _damage_step_4(run)
    before = snapshot(run)

    def refuse(src, dst):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), src)

    monkeypatch.setattr(loop.shutil, "move", refuse)
    with pytest.raises(SystemExit) as ex:
        run_main("dsjax.train", lambda: loop.train(small(corpus, tmp_path, "train.steps=6"), from_intact=True))
    err = capsys.readouterr().err
    assert ex.value.code == 2 and err == (
        f"dsjax.train: error: --resume-from-intact: moving the damaged checkpoint step 4 ({run}/checkpoints/4) "
        f"into {run}/checkpoints-damaged failed: Permission denied\n"), err
    assert (run / "checkpoints" / "4").is_dir() and snapshot(run) == before


def tb_events(tb_dir):
    """Every event of every TensorBoard file in tb_dir: [(file, Event)] (TFRecord framing:
    u64 length, u32 crc, payload, u32 crc)."""
    import struct

    from tensorboardX.proto import event_pb2
    out = []
    for f in sorted(Path(tb_dir).glob("events.out.tfevents.*")):
        data, i = f.read_bytes(), 0
        while i < len(data):
            n = struct.unpack("<Q", data[i:i + 8])[0]
            e = event_pb2.Event()
            e.ParseFromString(data[i + 12:i + 12 + n])
            out.append((f.name, e))
            i += 12 + n + 4
    return out


def test_resume_moves_records_logged_after_the_checkpoint_aside(corpus, finished_run, tmp_path):
    """A run logged steps 3 and 4 after its checkpoint at step 2 and died before checkpoint 4
    was saved (emulated: checkpoint 4 removed, a line cut short at the end of metrics.jsonl).
    Resumed from step 2, metrics.jsonl holds every step once; the earlier records of steps 3-4
    and the cut line are in metrics.superseded.jsonl; TensorBoard gets purge step 3."""
    from tensorboardX import SummaryWriter

    run = copy_run(finished_run, tmp_path)
    shutil.rmtree(run / "checkpoints" / "4")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 3.')
    before = (run / "metrics.jsonl").read_text().splitlines()
    old_tb = SummaryWriter(str(run / "tb"))
    for s in (1, 2, 3, 4):
        old_tb.add_scalar("loss", 10.0 + s, s)
    old_tb.close()
    cfg = small(corpus, tmp_path, "train.steps=5", "checkpoint.every=2", "train.tensorboard=true")
    assert loop.train(cfg, resume=True)["steps"] == 5

    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in recs if "val_loss" in r] == [0, 5]
    moved = (run / "metrics.superseded.jsonl").read_text().splitlines()
    assert moved == [l for l in before if not l.startswith(('{"step": 0,', '{"step": 1,', '{"step": 2,'))]
    assert [json.loads(l)["step"] for l in moved[:-1]] == [3, 4, 4] and moved[-1] == '{"step": 5, "loss": 3.'
    assert recs[:3] == [json.loads(l) for l in before[:3]]  # steps 0-2 kept as they were

    events = tb_events(run / "tb")
    new_files = {name for name, e in events if e.HasField("session_log")}
    assert len(new_files) == 1
    starts = [e.step for name, e in events if e.HasField("session_log")]
    assert starts == [3]
    new_loss = [e.step for name, e in events if name in new_files and e.HasField("summary")
                and e.summary.value[0].tag == "loss"]
    assert new_loss == [3, 4, 5]


# ---------------------------------------------------------------------------------------------
# Config: ranges, YAML oddities, fuzz
# ---------------------------------------------------------------------------------------------

def test_every_numeric_field_has_a_range():
    mesh = {f"mesh.{a}" for a in ("data", "fsdp", "expert", "tensor", "context", "devices")}
    assert set(C.numeric_fields()) - mesh == set(checks._RANGES)


@pytest.mark.parametrize("override, needle", [
    ("optim.min_lr_ratio=-1", "optim.min_lr_ratio must be in [0, 1]"),
    ("optim.b1=1.5", "optim.b1 must be in [0, 1)"),
    ("optim.b2=1.0", "optim.b2 must be in (0, 1)"),
    ("optim.weight_decay=-0.1", "optim.weight_decay must be in [0, inf)"),
    ("optim.grad_clip_norm=-1", "optim.grad_clip_norm must be in [0, inf)"),
    ("optim.learning_rate=nan", "optim.learning_rate must be a finite number"),
    ("optim.learning_rate=inf", "optim.learning_rate must be a finite number"),
    ("optim.learning_rate=-1e-3", "optim.learning_rate must be in [0, inf)"),
    ("train.eval_every=0", "train.eval_every must be in [1, inf)"),
    ("train.eval_batches=0", "train.eval_batches must be in [1, inf)"),
    ("train.eval_batches=-1", "train.eval_batches must be in [1, inf)"),
    ("optim.decay_steps=0", "optim.decay_steps must be in [1, inf)"),
    ("data.seed=-1", "data.seed must be in [0, 4294967296)"),
    ("data.train=[]", "data.train must name at least one source"),
    ("train.max_skipped_steps=0", "train.max_skipped_steps must be in [1, inf)"),
])
def test_out_of_range_values_are_refused(override, needle):
    with pytest.raises(C.ConfigError) as e:
        C.load(ROOT / "configs" / "tiny.yaml", [override])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_duplicate_yaml_key_and_binary_config_name_the_file(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("optim:\n  learning_rate: 1e-3\n  warmup_steps: 3\n  learning_rate: 2e-3\n")
    with pytest.raises(C.ConfigError, match=rf"{dup} line 4: invalid YAML \(duplicate key 'learning_rate'\)"):
        C.load(dup)
    top = tmp_path / "top.yaml"
    top.write_text("optim: {b1: 0.9}\noptim: {b2: 0.9}\n")
    with pytest.raises(C.ConfigError, match="duplicate key 'optim'"):
        C.load(top)
    binary = tmp_path / "c.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(C.ConfigError, match=rf"config: {binary}: not UTF-8 text \(byte 0x89 at offset 0\)"):
        C.load(binary)


def test_late_errors_come_before_the_run_dir(corpus, tmp_path):
    cases = [
        (["data.train=[/nonexistent/dsjax/*.txt]"], FileNotFoundError, "matches no file"),
        (["data.train=[/nonexistent/dsjax/file.txt]"], FileNotFoundError,
         "config: data.train\\[0\\]: /nonexistent/dsjax/file.txt does not exist"),
        (["model.vocab_size=200"], C.ConfigError, "needs a vocabulary of at least 258"),
    ]
    for extra, exc, needle in cases:
        cfg = small(corpus, tmp_path, *extra)
        with pytest.raises(exc, match=needle):
            loop.train(cfg)
        assert not (tmp_path / "run").exists(), extra
    # a user tokenizer larger than model.vocab_size: refused before any training or writing
    tok = tmp_path / "cache"
    cfg = small(corpus, tmp_path, "train.steps=1")
    built, _, _ = loop.build_data(cfg)
    cfg = small(corpus, tmp_path, f"data.tokenizer={built.path}", "model.vocab_size=280")
    with pytest.raises(C.ConfigError, match="model.vocab_size=280 is smaller than the tokenizer's 300"):
        loop.train(cfg)
    assert not (tmp_path / "run").exists() and tok.is_dir()


def test_missing_inputs_name_their_field(corpus, tmp_path, monkeypatch, capsys):
    """Every path-valued field that names something missing (or of the wrong kind): one line
    naming the field and the path, before anything is built or written."""
    (tmp_path / "empty" / ".hidden").mkdir(parents=True)
    (tmp_path / "empty" / ".hidden" / "x.txt").write_text("hidden files are not data")
    (tmp_path / "empty" / ".dotfile").write_text("nor dot files")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "not_a_run").mkdir()
    tok = tmp_path / "tok.json"
    tok.write_text("{}")
    conv = tmp_path / "conv.jsonl"
    conv.write_text('{"messages": []}\n')
    built = []
    monkeypatch.setattr(loop, "build_data", lambda *a, **k: built.append(1) or pytest.fail("built data"))
    cases = [
        (["data.train=/nonexistent"], FileNotFoundError, "config: data.train[0]: /nonexistent does not exist"),
        ([f"data.train=[{corpus}/*.py, {tmp_path}/nope/*.txt]"], FileNotFoundError,
         f"config: data.train[1]: {tmp_path}/nope/*.txt: glob matches no file"),
        ([f"data.train=[{tmp_path}/empty]"], FileNotFoundError,
         f"config: data.train[0]: {tmp_path}/empty is a directory that holds no file"),
        ([f"data.validation=[{corpus}/textwrap.py, /nonexistent/val.txt]"], FileNotFoundError,
         "config: data.validation[1]: /nonexistent/val.txt does not exist"),
        (["data.tokenizer=/nonexistent/tokenizer.json"], FileNotFoundError,
         "config: data.tokenizer: /nonexistent/tokenizer.json does not exist"),
        ([f"data.tokenizer={tmp_path}"], C.ConfigError, f"config: data.tokenizer: {tmp_path} is not a file"),
        ([f"data.cache_dir={tmp_path}/a_file"], C.ConfigError,
         f"config: data.cache_dir: {tmp_path}/a_file exists and is not a directory"),
        (["train.init_from=/nonexistent"], FileNotFoundError, "config: train.init_from: /nonexistent does not exist"),
        ([f"train.init_from={tmp_path}/not_a_run"], FileNotFoundError,
         f"config: train.init_from: {tmp_path}/not_a_run is not a dsjax run directory (it has no checkpoints/ "
         f"directory)"),
        (["train.init_from_hf=/nonexistent/hf"], FileNotFoundError,
         "config: train.init_from_hf: /nonexistent/hf does not exist"),
        ([f"data.train=[{conv}]", "data.format=chat", f"data.tokenizer={tok}",
          "data.chat_template=/nonexistent/chat.jinja"], FileNotFoundError,
         "config: data.chat_template: /nonexistent/chat.jinja does not exist"),
    ]
    for extra, exc, line in cases:
        cfg = small(corpus, tmp_path, *extra)
        with pytest.raises(exc) as e:
            loop.train(cfg)
        assert str(e.value) == line, (extra, str(e.value))
        assert not (tmp_path / "run").exists() and not built, extra
    # through the command: the line, exit 2
    argv = ["python -m dsjax.train", "--config", str(ROOT / "configs" / "tiny.yaml")]
    for s in small_sets(corpus, tmp_path, "data.train=/nonexistent"):
        argv += ["--set", s]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as ex:
        run_main("dsjax.train", train_main)
    assert ex.value.code == 2
    assert capsys.readouterr().err == "dsjax.train: error: config: data.train[0]: /nonexistent does not exist\n"
    assert not (tmp_path / "run").exists()


# --- fuzz: >= 200 generated malformed configs and overrides --------------------------------------

def _bad_values(key: str, interval: str, is_int: bool) -> list[str]:
    lo_text, hi_text = (t.strip() for t in interval[1:-1].split(","))
    out = []
    lo, hi = float(lo_text), float(hi_text)
    if np.isfinite(lo):
        out.append(str(int(lo) - 1) if is_int else repr(lo if interval[0] == "(" else lo - 0.5))
    if np.isfinite(hi):
        out.append(str(int(hi) + (0 if interval[-1] == ")" else 1)) if is_int
                   else repr(hi if interval[-1] == ")" else hi + 0.5))
    out += ["nan", "inf", "-inf"] if not is_int else ["1.5", "true"]
    out += ["abc", "[1, 2]", "{a: 1}"]
    return out


def field_type(key: str):
    cls = C.Config
    for part in key.split("."):
        tp, _ = schema._strip_optional(typing.get_type_hints(cls)[part])
        cls = tp
    return tp


def malformed_cases(seed: int = 0) -> list[tuple[str, list[str], str | bytes | None]]:
    """(name, overrides, YAML text or None) cases, each of which must be refused."""
    rng = random.Random(seed)
    hints = {f"{sec}.{f.name}" for sec in ("model", "optim", "data", "train", "checkpoint", "distributed")
             for f in dataclasses.fields(getattr(C.Config(), sec))}
    cases = []
    for key, interval in sorted(checks._RANGES.items()):
        is_int = field_type(key) is int
        if key.startswith("model.rope_scaling."):
            sub = key.split(".")[-1]
            for v in _bad_values(key, interval, is_int)[:2]:
                cases.append((key, [f"model.rope_scaling={{{sub}: {v}}}"], None))
            continue
        for v in _bad_values(key, interval, is_int):
            cases.append((key, [f"{key}={v}"], None))
    for key in sorted(checks._CHOICES):
        if not key.startswith("model.rope_scaling"):
            cases.append((key, [f"{key}=bogus_{rng.randrange(1000)}"], None))
    valid = sorted(hints)
    for key in rng.sample(valid, 25):  # typos: a dropped, doubled or swapped character
        i = rng.randrange(1, len(key) - 1)
        typo = rng.choice([key[:i] + key[i + 1:], key[:i] + key[i] + key[i:],
                           key[:i - 1] + key[i] + key[i - 1] + key[i + 1:]])
        if typo not in hints and typo.split(".")[0] in ("model", "optim", "data", "train", "checkpoint",
                                                        "distributed") or typo.split(".")[0] not in hints:
            if typo not in hints:
                cases.append(("typo", [f"{typo}=1"], None))
    cases += [
        ("no equals", ["optim.learning_rate"], None),
        ("section as scalar", ["model=3"], None),
        ("field as section", ["model.hidden_size.x=3"], None),
        ("empty key", ["=3"], None),
        ("bad yaml value", ["optim.b1=[0.9"], None),
        ("list for scalar", ["train.steps=[1, 2]"], None),
        ("empty cache_dir", ["data.cache_dir="], None),
        ("empty source", ["data.train=['']"], None),
        ("seed too big", ["data.seed=99999999999"], None),
        ("combination", ["optim.b1=0.5", "optim.b2=1.5"], None),
        ("combination2", ["train.eval_every=0", "train.eval_batches=0"], None),
        ("dup key", [], "optim:\n  b1: 0.9\n  b1: 0.8\n"),
        ("dup section", [], "train: {steps: 3}\ntrain: {steps: 4}\n"),
        ("dup nested", [], "model:\n  rope_scaling:\n    factor: 2\n    factor: 3\n"),
        ("top list", [], "- a\n- b\n"),
        ("top scalar", [], "hello\n"),
        ("tab indent", [], "optim:\n\tb1: 0.9\n"),
        ("unclosed", [], "optim: {b1: 0.9\n"),
        ("complex key", [], "? [a, b]\n: 1\n"),
        ("unknown section", [], "optimizer:\n  b1: 0.9\n"),
        ("section list", [], "optim:\n  - b1\n"),
        ("bad alias", [], "optim: *nothere\n"),
        ("nan in yaml", [], "optim:\n  learning_rate: .nan\n"),
        ("bool as int", [], "train:\n  steps: yes\n"),
        ("negative warmup", [], "optim:\n  warmup_steps: -5\n"),
        ("binary", [], b"\xff\xfe\x00o\x00p\x00t"),
        ("latin-1", [], "optim:\n  schedule: caf\xe9\n".encode("latin-1")),
    ]
    return cases


def run_case(tmp_path, i, overrides, text):
    path = None
    if text is not None:
        path = tmp_path / f"case{i}.yaml"
        (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path, [*overrides, f"train.run_dir={tmp_path}/run{i}"]


def test_fuzz_malformed_configs_fail_in_one_line(tmp_path):
    cases = malformed_cases()
    assert len(cases) >= 200, len(cases)
    for i, (name, overrides, text) in enumerate(cases):
        path, sets = run_case(tmp_path, i, overrides, text)
        try:
            C.load(path, sets)
        except C.ConfigError as e:
            msg = str(e)
        else:
            pytest.fail(f"accepted: {name} {overrides} {text!r}")
        assert msg.startswith("config: ") and "\n" not in msg, (name, overrides, msg)
        if name in checks._RANGES or name in checks._CHOICES:
            assert name.split(".")[-1] in msg, (name, overrides, msg)
        if text is not None and name not in ("unknown section", "section list", "nan in yaml",
                                              "bool as int", "negative warmup"):
            assert str(path) in msg, (name, msg)  # YAML-level faults name the file


def test_fuzz_sample_through_the_cli(tmp_path, monkeypatch, capsys):
    # the command for a sample: exit 2, exactly one stderr line, no run directory. The last case
    # (a binary file) runs as a real `python -m dsjax.train` process; the others run the same
    # entry point (dsjax.train.__main__.main under run_main, on these arguments) in this process
    cases = malformed_cases()
    sample = random.Random(1).sample(range(len(cases)), 9) + [len(cases) - 2]  # + a binary file
    for i in sample:
        name, overrides, text = cases[i]
        path, sets = run_case(tmp_path, i, overrides, text)
        argv = ["--config", str(path)] if path else []
        for s in sets:
            argv += ["--set", s]
        if i == sample[-1]:
            r = subprocess.run([sys.executable, "-m", "dsjax.train", *argv], cwd=ROOT, capture_output=True,
                               text=True, timeout=120)
            code, stderr = r.returncode, r.stderr
        else:
            monkeypatch.setattr(sys, "argv", ["python -m dsjax.train", *argv])
            with pytest.raises(SystemExit) as ex:
                run_main("dsjax.train", train_main)
            code, stderr = ex.value.code, capsys.readouterr().err
        lines = [l for l in stderr.splitlines() if l.strip()]
        assert code == 2 and len(lines) == 1, (name, code, stderr[-2000:])
        assert lines[0].startswith("dsjax.train: error: config: "), lines
        assert not (tmp_path / f"run{i}").exists()


def test_summary_line_survives_non_finite_numbers(monkeypatch, capsys):
    """A finished run whose summary holds non-finite numbers (a custom loader's non-finite loss
    mask makes the token count infinite; a NaN validation loss) still prints one JSON summary
    line, with null for those numbers, and exits normally."""
    import dsjax.train.__main__ as cli
    summary = {"steps": 4, "wall_s": 12.34, "train_s": float("inf"), "tokens_per_s": float("inf"),
               "val_loss": {"0": 6.27001, "4": float("nan")}, "run_dir": "runs/x"}
    monkeypatch.setattr(cli, "load_config", lambda args: None)
    monkeypatch.setattr(cli, "train", lambda cfg, **kw: summary)
    monkeypatch.setattr(sys, "argv", ["dsjax.train", "--config", "unused.yaml"])
    cli.main()
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("summary ")
    line = json.loads(out[0][len("summary "):])
    assert line == {"steps": 4, "wall_s": 12.3, "train_s": None, "tokens_per_s": None,
                    "val_loss": {"0": 6.27, "4": None}, "run_dir": "runs/x"}
