"""Config loading: typing of YAML and --set values, one-line errors naming the key."""
import subprocess
import sys
from pathlib import Path

import pytest

from dsjax import config as C

ROOT = Path(__file__).resolve().parents[2]


def test_yaml_and_set_floats(tmp_path):
    # case 2: YAML 1.1 loaders read 3e-4 as a string; we must give floats
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  learning_rate: 3e-4\n  warmup_steps: 10\n")
    cfg = C.load(p)
    assert cfg.optim.learning_rate == pytest.approx(3e-4) and isinstance(cfg.optim.learning_rate, float)
    cfg = C.load(p, ["optim.learning_rate=1e-5"])
    assert cfg.optim.learning_rate == pytest.approx(1e-5) and isinstance(cfg.optim.learning_rate, float)
    assert isinstance(cfg.optim.warmup_steps, int)


def test_string_field_keeps_text(tmp_path):
    cfg = C.load(None, ["train.run_dir=1e5", "data.cache_dir=007"])
    assert cfg.train.run_dir == "1e5"
    assert cfg.data.cache_dir == "007"
    # the same from a YAML file, where a YAML 1.1 loader would read 1e5 as a number
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  run_dir: 1e5\ndata:\n  cache_dir: 007\n")
    cfg = C.load(p, [])
    assert cfg.train.run_dir == "1e5" and cfg.data.cache_dir == "007"


def test_ints_bools_optionals_lists_nested():
    cfg = C.load(None, ["model.hidden_size=64", "model.q_lora_rank=null", "model.norm_topk_prob=false",
                        "data.train=[a.txt, b.jsonl]", "model.rope_scaling={factor: 40, mscale_all_dim: 1}",
                        "model.first_k_dense_replace=1.0"])
    m = cfg.model
    assert m.hidden_size == 64 and m.q_lora_rank is None and m.norm_topk_prob is False
    assert cfg.data.train == ["a.txt", "b.jsonl"]
    assert m.rope_scaling.factor == 40.0 and isinstance(m.rope_scaling.factor, float)
    assert m.rope_scaling.mscale is None and m.rope_scaling.mscale_all_dim == 1.0
    assert m.first_k_dense_replace == 1


@pytest.mark.parametrize("override, needle", [
    ("optim.learing_rate=1", "unknown key 'optim.learing_rate' (did you mean 'optim.learning_rate'?)"),
    ("modle.hidden_size=1", "unknown key 'modle' (did you mean 'model'?)"),
    ("model.hidden_size=abc", "model.hidden_size must be an int, got 'abc'"),
    ("train.steps=1.5", "train.steps must be an int"),
    ("model.norm_topk_prob=maybe", "model.norm_topk_prob must be a bool"),
    ("optim.learning_rate=fast", "optim.learning_rate must be a float"),
    ("model.topk_method=top1", "model.topk_method='top1': expected one of"),
    ("model.n_group=3", "model.n_group=3 must divide n_routed_experts"),
    ("model.num_experts_per_tok=99", "model.num_experts_per_tok=99 exceeds"),
    ("data.seq_len=999999", "data.seq_len=999999 exceeds model.max_position_embeddings"),
])
def test_errors_name_the_key(override, needle):
    with pytest.raises(C.ConfigError) as e:
        C.load(None, [override])
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_nested_section_given_scalar():
    with pytest.raises(C.ConfigError, match="model must be a mapping"):
        C.load(None, ["model=3"])


def test_repo_configs_load():
    for p in sorted((ROOT / "configs").glob("*.yaml")):
        C.load(p)


def test_roundtrip_through_dict():
    cfg = C.load(ROOT / "configs" / "tiny.yaml", ["model.rope_scaling={factor: 4}"])
    assert C.from_dict(C.to_dict(cfg)) == cfg


def test_cli_bad_key_fails_fast_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dsjax.train", "--config", str(ROOT / "configs" / "tiny.yaml"),
                        "--set", "optim.lr=1e-3", "--set", f"train.run_dir={tmp_path}/run"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2
    lines = [l for l in r.stderr.strip().splitlines() if l]
    assert lines[-1].startswith("dsjax.train: error: config: unknown key 'optim.lr'")
    assert len(lines) == 1, r.stderr
    assert not (tmp_path / "run").exists()  # no work done


@pytest.mark.parametrize("overrides, needle", [
    (["model.attention_impl=pallas", "model.dtype=float32"],
     "model.attention_impl=pallas does not fit model.dtype=float32"),
    (["model.moe_impl=pallas", "model.dtype=float32"], "model.moe_impl=pallas does not fit model.dtype=float32"),
    (["model.attention_impl=pallas", "model.dtype=bfloat16", "model.v_head_dim=96"],
     "v_head_dim=96: Dv=96: the Mosaic GPU kernel takes head dims that are multiples of 64"),
    (["model.moe_impl=pallas", "model.dtype=bfloat16", "model.moe_intermediate_size=1344"],
     "moe_intermediate_size=1344: output width 1344 must be a multiple of 128"),
])
def test_pallas_impls_the_kernels_cannot_take_are_refused(overrides, needle):
    with pytest.raises(C.ConfigError) as e:
        C.load(ROOT / "configs" / "deepseek_v2_lite.yaml", overrides)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_pallas_impls_accepted_where_the_kernels_fit():
    cfg = C.load(ROOT / "configs" / "deepseek_v2_lite.yaml",
                 ["model.attention_impl=pallas", "model.moe_impl=pallas", "model.dtype=bfloat16"])
    assert (cfg.model.attention_impl, cfg.model.moe_impl) == ("pallas", "pallas")


def test_pallas_impl_refused_by_the_cli_before_the_run_dir(tmp_path):
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "dsjax.train", "--config", str(ROOT / "configs" / "tiny.yaml"),
                        "--set", "model.attention_impl=pallas", "--set", f"train.run_dir={run}"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "model.attention_impl=pallas does not fit model.dtype=float32" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    assert not run.exists()


def test_a_bf16_moment_that_cannot_decay_is_refused():
    """bf16 second moment with b2 = 0.999: 0.999 * v rounds back to v, so it would never decay."""
    import jax.numpy as jnp
    with pytest.raises(C.ConfigError) as e:
        C.load(ROOT / "configs" / "tiny.yaml", ["optim.nu_dtype=bfloat16", "optim.b2=0.999"])
    msg = str(e.value)
    assert "optim.b2=0.999 with optim.nu_dtype=bfloat16" in msg and "optim.b2 <= 0.996094" in msg, msg
    with pytest.raises(C.ConfigError, match="optim.b1=0.998 with optim.mu_dtype=bfloat16"):
        C.load(ROOT / "configs" / "tiny.yaml", ["optim.mu_dtype=bfloat16", "optim.b1=0.998"])
    v = jnp.asarray(1.0, jnp.bfloat16)
    assert (jnp.float32(0.999) * v.astype(jnp.float32)).astype(jnp.bfloat16) == v  # the stall itself
    for sets in (["optim.nu_dtype=bfloat16", "optim.b2=0.95"], ["optim.nu_dtype=bfloat16", "optim.b2=0.996"],
                 ["optim.b2=0.999"]):  # DeepSeek's b2 in bf16; the threshold; fp32 moments
        C.load(ROOT / "configs" / "tiny.yaml", sets)
