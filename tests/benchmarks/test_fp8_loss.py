"""`benchmarks/fp8_loss.py --tiny`: both runs train on real text from the same batches and seed,
and the table, the losses and the PNG are written; a bad override is one line, exit 2, nothing
written."""
import json
import os
import shutil
import sys

import pytest

from dsjax.data import stdlib_files

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import fp8_loss as FL  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for f in stdlib_files():
        if f.name in {"textwrap.py", "bisect.py", "heapq.py", "fnmatch.py", "shlex.py", "glob.py"}:
            shutil.copy(f, d / f.name)
    return d


def test_tiny_run_writes_table_losses_and_png(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    rc = FL.main(["--tiny", "--steps", "4", "--every", "2", "--out", str(out), "--set",
                  f"data.train=[{corpus}/*.py]", "data.validation=[]", "data.val_fraction=0",
                  f"data.cache_dir={tmp_path}/cache", "model.num_hidden_layers=2"])
    assert rc == 0
    table = (out / "fp8_loss.md").read_text()
    assert "| step | loss bf16 | loss fp8 | relative gap |" in table
    assert "mean gap over the last 2 steps" in table and "0.25% target" in table
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == [1, 2, 4]
    rec = json.loads((out / "fp8_loss.json").read_text())
    a, b = rec["loss_bf16"], rec["loss_fp8"]
    assert len(a) == len(b) == 4
    assert abs(b[0] - a[0]) / a[0] < 1e-2  # step 1: same weights and batch, FP8 rounding only
    assert a != b  # the fp8 run did run in FP8
    png = (out / "fp8_loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert "mean gap over the last 2 steps" in capsys.readouterr().out


def test_bad_override_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        FL.main(["--tiny", "--out", str(out), "--set", "model.no_such_field=1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp8_loss: error:") and "no_such_field" in err[0]
    assert not out.exists()
