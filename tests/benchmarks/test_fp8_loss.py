"""`benchmarks/fp8_loss.py --tiny`: both runs train on real text from the same batches and seed,
FP8 training follows bf16 within a justified bound, and the table, the losses and the PNG are
written; a bad override is one line, exit 2, nothing
written."""
import json
import os
import shutil
import sys

import numpy as np
import pytest

from dsjax.data import stdlib_files

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import fp8_loss as FL  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for f in stdlib_files():
        if f.name in {"textwrap.py", "bisect.py", "heapq.py", "fnmatch.py", "shlex.py", "colorsys.py",
                      "queue.py", "glob.py"}:
            shutil.copy(f, d / f.name)
    return d


def test_tiny_fp8_run_trains_like_bf16_and_writes_table_losses_and_png(corpus, tmp_path, capsys):
    """configs/tiny.yaml (128 wide: every hidden width fits or is a partial 128 tile: q_lora 64,
    kv_a 48, experts 96) trained 20 steps from the same seed and batches with model.fp8=none and
    blockwise, through the XLA reference (quantise, dequantise, fp32 dots). Measured on CPU: step
    1 (same weights) differs by 2.0e-4 relative; later steps by up to 2.5 % single-step as the
    two runs' trajectories separate, and the mean of the last 5 losses by -0.25 % (fp8 lower;
    -0.34 % after 30 steps, -0.52 % after 40). DeepSeek's < 0.25 % is for ~1T tokens, where
    single-step noise averages out (on a GPU, 300 steps of V2-Lite geometry: -0.008 %); here we
    allow 1e-3 at step 1 and 2 % on the last-5 mean (4x the largest gap measured), and ask the
    FP8 run to learn (its last losses 0.3 below its first). Then the table, the losses and the
    PNG the benchmark writes."""
    out = tmp_path / "out"
    rc = FL.main(["--tiny", "--steps", "20", "--batch", "8", "--every", "10", "--out", str(out), "--set",
                  f"data.train=[{corpus}/*.py]", "data.validation=[]", "data.val_fraction=0.25",
                  f"data.cache_dir={tmp_path}/cache", "model.vocab_size=512", "optim.warmup_steps=5",
                  "optim.learning_rate=3e-3"])
    assert rc == 0
    rec = json.loads((out / "fp8_loss.json").read_text())
    a, b = np.array(rec["loss_bf16"]), np.array(rec["loss_fp8"])
    assert len(a) == len(b) == 20
    gap = (b - a) / a
    last5 = (b[-5:].mean() - a[-5:].mean()) / a[-5:].mean()
    print(f"fp8 vs none: step-1 gap {gap[0]:.2e}, max step gap {np.abs(gap).max():.3f}, last-5 mean gap {last5:.4f}")
    assert abs(gap[0]) < 1e-3
    assert abs(last5) < 0.02
    assert b[-3:].mean() < b[:3].mean() - 0.3
    table = (out / "fp8_loss.md").read_text()
    assert "| step | loss bf16 | loss fp8 | relative gap |" in table
    assert "mean gap over the last 10 steps" in table and "0.25% target" in table
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == [1, 10, 20]
    png = (out / "fp8_loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert "mean gap over the last 10 steps" in capsys.readouterr().out


def test_bad_override_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        FL.main(["--tiny", "--out", str(out), "--set", "model.no_such_field=1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp8_loss: error:") and "no_such_field" in err[0]
    assert not out.exists()
