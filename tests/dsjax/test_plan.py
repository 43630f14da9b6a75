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


def test_plan_counts_a_lora_state_as_the_run_builds_it():
    """With LoRA the plan's state is the run's: adapters trainable (fp32, two fp32 moments), the
    base weights frozen in the compute dtype without moments; the compiled arguments match."""
    import jax
    import numpy as np

    from dsjax import config as C
    from dsjax.plan import compile_memory
    from dsjax.train import finetune

    cfg = C.load(ROOT / "configs" / "tiny.yaml", ["mesh.preset=fsdp", "lora.rank=4", "lora.alpha=8",
                                                   "lora.target_modules=[q_b_proj, kv_b_proj, experts]"])
    _, params, _ = finetune.init_model(cfg)
    trainable, frozen = finetune.partition(cfg, params)
    nbytes = lambda t: sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(t))  # noqa: E731
    m = compile_memory(cfg, 1, hopper_kernels=False)
    assert m["params"] == nbytes(trainable) > 0
    assert m["frozen"] == nbytes(frozen) > 10 * m["params"]
    assert m["optimizer"] >= 2 * m["params"]  # fp32 first and second moments of the adapters only
    assert m["argument"] >= m["params"] + m["optimizer"] + m["frozen"]
