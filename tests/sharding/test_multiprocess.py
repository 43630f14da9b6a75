"""Two processes x 4 CPU devices through jax.distributed (gloo) reproduce the one-process
8-device losses, and only process 0 writes the run directory's own files (orbax writes the
checkpoint collectively); a process that dies makes the other exit with an error instead of
hanging."""
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from sharding_common import ROOT, cached_run, mp_run_cfg  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402

from dsjax import config as C  # noqa: E402
from dsjax.checkpoint import Checkpointer  # noqa: E402

WORKER = Path(__file__).parent / "mp_worker.py"


def _port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(mode, tmp_path):
    port = _port()
    procs = []
    for pid in range(2):
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(pid), str(port), mode, str(tmp_path / f"out{pid}.json")],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def test_two_processes_reproduce_single_process_losses(tmp_path):
    # the tokenizer file the run keeps a copy of (the worker feeds synthetic token ids)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0")).save(
        str(tmp_path / "tokenizer.json"))
    procs = _launch("train", tmp_path)
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-3000:]
    ref = cached_run("fsdp=8", ["mesh.preset=fsdp", "mesh.fsdp=8"])[0]
    for pid in range(2):
        got = json.loads((tmp_path / f"out{pid}.json").read_text())
        err = max(abs(a - b) for a, b in zip(got["losses"], ref))
        print(f"\nprocess {pid}: losses {got['losses']} vs 1-process {ref}: max err {err:.2e}")
        assert got["mesh"]["fsdp"] == 8
        assert err < 1e-5
    # the run directory: written once, by process 0
    cfg = mp_run_cfg(tmp_path)
    run = tmp_path / "run"
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3], recs  # one line per logged step
    assert [r["loss"] for r in recs] == got["losses"]
    events = [p for p in (run / "tb").rglob("*") if p.is_file()]
    assert len(events) == 1 and events[0].name.startswith("events.out.tfevents"), events
    assert (run / "config.yaml").read_text() == C.dump_yaml(cfg)
    assert C.load(run / "config.yaml") == cfg
    assert (run / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl", "tb",
                                                      "tokenizer.json"]
    ck = Checkpointer(run / "checkpoints", read_only=True)
    assert ck.all_steps() == [3] and ck.verify(3) is None
    assert not list((run / "checkpoints" / "3").glob("*.tmp"))


def test_dead_process_makes_the_other_fail_not_hang(tmp_path):
    t0 = time.time()
    procs = _launch("die", tmp_path)
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a surviving process hung after its peer died")
    print(f"\nsurvivor exit code {procs[0].returncode} after {time.time() - t0:.0f} s; tail: "
          f"{outs[0].strip().splitlines()[-1][:300] if outs[0].strip() else ''}")
    assert procs[1].returncode == 3
    assert procs[0].returncode != 0
