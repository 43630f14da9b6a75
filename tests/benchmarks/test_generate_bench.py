"""`benchmarks/generate.py` on CPU: the --tiny smoke run (absorbed and expanded, bf16 and int8)
and the bytes it counts."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import generate as GB  # noqa: E402


def test_tiny_smoke_run(capsys):
    rows = GB.main(["--tiny"])
    assert len(rows) == 4 and {(r["mode"], r["cache_dtype"]) for r in rows} == {
        (m, d) for m in ("absorbed", "expanded") for d in ("bfloat16", "int8")}
    for r in rows:
        assert "error" not in r and r["finite"] and r["tokens_per_s"] > 0 and r["floor_ms"] > 0
    gb = {r["cache_dtype"]: r["cache_gb"] for r in rows}
    # 2 layers x 2 rows x 64 slots: bf16 (32 + 16) x 2 bytes; int8 32 + 4 + 16 x 2 bytes
    assert gb["bfloat16"] * 1e9 == 2 * 2 * 64 * 48 * 2 and gb["int8"] * 1e9 == 2 * 2 * 64 * (32 + 4 + 32)
    assert "copy bandwidth" in capsys.readouterr().out


def test_weight_bytes_at_v2_lite_geometry():
    cfg = GB.model_config(27, tiny=False)
    b1, b64 = GB.step_weight_bytes(cfg, 1), GB.step_weight_bytes(cfg, 64)
    assert 4.0e9 < b1 < 6.5e9  # ~2.4 B active params (bf16), the lm_head included
    assert b64 > 2 * b1  # most experts touched at batch 64
    # free: what an H100 (76 GB at XLA_PYTHON_CLIENT_MEM_FRACTION=0.95) or an H200 (132 GB) has
    # left with the 31 GB of weights resident
    assert not GB.fits(cfg, 64, 32768, "absorbed", "bfloat16", 45e9)  # 65 GB of cache
    assert GB.fits(cfg, 64, 32768, "absorbed", "int8", 45e9)  # 36.5 GB
    assert GB.fits(cfg, 64, 32768, "absorbed", "bfloat16", 101e9)
