"""A reduced DeepSeek-V3 (V3 widths and per-device shapes, 2 MoE layers, expert=8) compiled on 8
fake CPU devices as `dsjax.plan` compiles it (Hopper kernel stand-ins): its temporaries stay
under a bound, so a regression in the expert dispatch (buffers sized by every gathered token
x top-k at once) or in weight gathering (several layers' weights gathered together) fails on
CPU. `python -m dsjax.plan --explain` names the buffers when it does."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from sharding_common import ROOT  # noqa: E402

from dsjax import config as C  # noqa: E402
from dsjax.plan import compile_memory  # noqa: E402

GB = 1e9
# Per device (2026-12-01, jax 0.11.2): temporaries 33.99 GB; the same with all 8 x 4096 gathered
# tokens dispatched as one chunk: 49.02 GB. The largest buffers: the embedding table and the
# lm_head gathered with fp32 copies (3.7 GB each; XLA:CPU all-gathers in fp32), one layer's 32
# local experts gathered (0.94 GB a matrix in bf16), one dispatch chunk (4096 tokens x 8 copies
# x 7168, 0.47 GB); gathering a second layer's experts at the same time would add 2.8 GB more.
TEMP_BOUND_GB = 36.0


def test_reduced_v3_temporaries_bounded():
    cfg = C.load(ROOT / "configs" / "deepseek_v3.yaml",
                 ["model.num_hidden_layers=2", "model.first_k_dense_replace=0",
                  "model.num_nextn_predict_layers=0", "data.batch_size=8"])
    m = compile_memory(cfg, 8)
    print(f"\nreduced V3 on 8 devices: {({k: round(v / GB, 3) for k, v in m.items()})}")
    assert m["argument"] == m["params"] + m["optimizer"] + m["compute_copy"] + m["rest"] + m["batch"]
    assert m["temp"] < TEMP_BOUND_GB * GB, m["temp"] / GB
