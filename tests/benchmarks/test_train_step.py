"""`benchmarks/train_step.py`'s plumbing that runs without a GPU: the peers' arguments (which one
clips) and the memory line under the table."""
import json
import os
import subprocess
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import train_step as TS  # noqa: E402


def test_only_the_clipping_peer_asks_its_script_to_clip(monkeypatch):
    seen = {}

    def fake_run(argv, **_):
        seen[argv[-1]] = argv  # [python, -c, script, L, B, T, steps, compile, dir, clip]
        out = {"step_ms": 80.0, "tokens_per_s": 1e5, "devices": 1, "loss": 11.0, "peak_gb": 21.0, "gpu": None}
        return types.SimpleNamespace(returncode=0, stdout=json.dumps(out) + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = types.SimpleNamespace(layers=4, batch=4, seq=2048, steps=10)
    rows = {peer: TS.run_hf(args, peer) for peer in ("hf_compile", "hf_compile_clip")}
    assert rows["hf_compile"]["row"] == TS.HF_ROWS["hf_compile"][2]
    assert rows["hf_compile_clip"]["row"] == TS.HF_ROWS["hf_compile_clip"][2]
    assert sorted(seen) == ["0", "1"]  # the clip flag (the script's sys.argv[7]), one peer each
    assert all(len(a) == 10 and a[7] == "1" for a in seen.values())  # both compiled
    assert "clip = sys.argv[7] == \"1\"" in TS.HF_SCRIPT
    assert "if clip:" in TS.HF_SCRIPT and "clip_grad_norm_(model.parameters(), 1.0)" in TS.HF_SCRIPT


def test_memory_line_names_each_point_and_marks_what_was_not_read():
    line = TS.describe_memory({"state_in_use_gb": 13.55, "step_gb": 20.39, "state_peak_gb": 13.55,
                               "compile_peak_gb": 16.62, "first_step_peak_gb": 20.41})
    assert line == ("GB in use with the state 13.55; XLA's step footprint 20.39; allocator peak after the "
                    "state 13.55, after compiling 16.62, after the first step 20.41")
    assert TS.describe_memory({"step_gb": 0.01, "state_in_use_gb": None}).count("-") == 4


def test_torchtitan_peer_runs_its_own_script_with_the_step_geometry(monkeypatch):
    seen = []

    def fake_run(argv, **_):
        seen.append(argv)
        out = {"step_ms": 91.3, "tokens_per_s": 89_700.0, "devices": 1, "loss": 11.6, "peak_gb": 25.0, "gpu": None}
        return types.SimpleNamespace(returncode=0, stdout="log line\n" + json.dumps(out) + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = types.SimpleNamespace(layers=4, batch=4, seq=2048, steps=10)
    row = TS.run_hf(args, "torchtitan")
    assert row["row"] == TS.PEERS["torchtitan"].label and row["step_ms"] == 91.3
    (argv,) = seen
    assert argv[1].endswith(os.path.join("benchmarks", "torchtitan_step.py"))
    assert argv[2:] == ["4", "4", "2048", "10"]
    src = open(argv[1]).read()
    assert "clip_grad_norm_(model.parameters(), 1.0" in src and "fused=True" in src
    assert 'deepseekv3_configs["16B"]' in src and "block.compile(fullgraph=True)" in src


def test_a_failed_torchtitan_peer_is_a_row_with_its_error(monkeypatch):
    def fake_run(argv, **_):
        return types.SimpleNamespace(returncode=1, stdout="", stderr="Traceback\nModuleNotFoundError: No module named 'torchtitan'\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    row = TS.run_hf(types.SimpleNamespace(layers=4, batch=4, seq=2048, steps=10), "torchtitan")
    assert row == {"row": TS.PEERS["torchtitan"].label, "error": "ModuleNotFoundError: No module named 'torchtitan'"}


def test_fp8_rows_are_default_and_matched_with_blockwise_fp8():
    from dsjax import config as C
    for row, base in (("fp8_default", "default"), ("fp8_matched", "matched")):
        assert TS.DSJAX_ROWS[row] == TS.DSJAX_ROWS[base] + ["model.fp8=blockwise"]
        cfg = C.load(None, TS.V2_LITE + ["model.num_hidden_layers=4"] + TS.DSJAX_ROWS[row])
        ref = C.load(None, TS.V2_LITE + ["model.num_hidden_layers=4"] + TS.DSJAX_ROWS[base])
        assert cfg.model.fp8 == "blockwise" and ref.model.fp8 == "none"
        assert (cfg.model.weight_dtype, cfg.optim.mu_dtype) == (ref.model.weight_dtype, ref.optim.mu_dtype)
    assert C.load(None, TS.V2_LITE + TS.DSJAX_ROWS["fp8_matched"]).model.weight_dtype == "bfloat16"


def test_an_fp8_row_runs_as_its_own_child(monkeypatch):
    seen = []

    def fake_run(cmd, **_):
        seen.append(cmd)
        out = {"row": "dsjax fp8_matched", "step_ms": 70.0, "tokens_per_s": 1.2e5}
        return types.SimpleNamespace(returncode=0, stdout=json.dumps(out) + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = types.SimpleNamespace(layers=4, batch=4, seq=2048, steps=10, set=[], profile="", hlo="")
    row = TS.run_child(args, "fp8_matched")
    assert row["row"] == "dsjax fp8_matched" and row["step_ms"] == 70.0
    (cmd,) = seen
    assert cmd[cmd.index("--child") + 1] == "fp8_matched"
