"""`python -m dsjax.plan --explain` on the tiny config: the report names the temporaries live
at the peak with their HLO op and the repository source lines that made them."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_plan_explain_names_buffers_and_sources(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("DSJAX_PLAN_CHILD", None)
    r = subprocess.run([sys.executable, "-m", "dsjax.plan", "--config", str(ROOT / "configs" / "tiny.yaml"),
                        "--devices", "8", "--hbm-gb", "1", "--explain", "8", "--no-check",
                        "--dump-dir", str(tmp_path), "--set", "mesh.preset=fsdp", "--set", "mesh.fsdp=8"],
                       env=env, capture_output=True, text=True, timeout=900)
    out = r.stdout
    print(out[-3000:], r.stderr[-2000:])
    assert r.returncode == 0
    assert "largest temporaries live at the peak" in out and "grouped by innermost source line" in out
    assert "dsjax/model/" in out or "pallas_kernels/" in out or "sharding/" in out
    assert "fewest devices that fit 1 GB" in out
    assert list(tmp_path.glob("*buffer-assignment.txt"))
