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


# --- composition: several --config files, `base:` files, --set last -------------------------------

def _parse(argv):
    """`python -m dsjax.train`'s config arguments parsed and loaded as the command does."""
    import argparse

    from dsjax.cli import add_config_args, load_config
    p = argparse.ArgumentParser()
    add_config_args(p)
    return load_config(p.parse_args(argv))


def test_config_files_compose_left_to_right_and_set_wins(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("optim:\n  learning_rate: 7e-3\n  warmup_steps: 11\ndata:\n  seq_len: 48\n  train: [x.txt, y.txt]\n")
    b.write_text("optim:\n  learning_rate: 2.5e-4\ndata:\n  train: [z.jsonl]\ntrain:\n  steps: 17\n")
    cfg = _parse(["--config", str(a), "--config", str(b)])
    assert cfg.optim.learning_rate == pytest.approx(2.5e-4)  # b's value over a's
    assert cfg.optim.warmup_steps == 11 and cfg.data.seq_len == 48  # a's keys that b leaves alone
    assert cfg.data.train == ["z.jsonl"] and cfg.train.steps == 17  # lists are replaced
    assert cfg.optim.b1 == C.OptimConfig().b1  # the defaults under both
    rev = _parse(["--config", str(b), "--config", str(a)])
    assert rev.optim.learning_rate == pytest.approx(7e-3) and rev.data.train == ["x.txt", "y.txt"]
    over = _parse(["--config", str(a), "--config", str(b), "--set", "optim.learning_rate=3e-5",
                   "--set", "optim.warmup_steps=4"])
    assert over.optim.learning_rate == pytest.approx(3e-5) and over.optim.warmup_steps == 4
    assert C.load([a, b], ["optim.learning_rate=3e-5", "optim.warmup_steps=4"]) == over


def test_base_is_relative_to_its_file_and_chains(tmp_path):
    (tmp_path / "deep" / "deeper").mkdir(parents=True)
    root = tmp_path / "root.yaml"
    root.write_text("model:\n  hidden_size: 96\n  num_attention_heads: 3\noptim:\n  b1: 0.85\n")
    mid = tmp_path / "deep" / "mid.yaml"
    mid.write_text("base: ../root.yaml\nmodel:\n  num_attention_heads: 6\noptim:\n  b2: 0.9\n")
    leaf = tmp_path / "deep" / "deeper" / "leaf.yaml"
    leaf.write_text("base: ../mid.yaml  # relative to this file, not to the working directory\n"
                    "optim:\n  b2: 0.97\n")
    cfg = C.load(leaf)
    assert cfg.model.hidden_size == 96 and cfg.optim.b1 == pytest.approx(0.85)  # from root
    assert cfg.model.num_attention_heads == 6  # mid over root
    assert cfg.optim.b2 == pytest.approx(0.97)  # leaf over mid
    assert C.load(leaf, ["model.num_attention_heads=2"]).model.num_attention_heads == 2
    # a later --config file over a file with a base; the written config is the full resolved one
    other = tmp_path / "other.yaml"
    other.write_text("model:\n  hidden_size: 64\n")
    both = C.load([leaf, other])
    assert both.model.hidden_size == 64 and both.model.num_attention_heads == 6
    dumped = C.dump_yaml(both)
    assert "base" not in dumped and C.from_dict(yaml_load(dumped)) == both


def yaml_load(text):
    import yaml
    return yaml.safe_load(text)


def test_tiny_plus_a_data_only_file_is_the_tiny_model(tmp_path):
    mine = tmp_path / "my.yaml"
    mine.write_text(f"data:\n  train: [{tmp_path}/corpus/*.txt]\n  batch_size: 4\n  seq_len: 64\n")
    cfg = _parse(["--config", str(ROOT / "configs" / "tiny.yaml"), "--config", str(mine)])
    tiny = C.load(ROOT / "configs" / "tiny.yaml")
    assert cfg.model == tiny.model and cfg.optim == tiny.optim and cfg.train == tiny.train
    assert cfg.model.hidden_size == 128 and cfg.model.vocab_size == 512 and cfg.model.q_lora_rank == 64
    assert cfg.data.train == [f"{tmp_path}/corpus/*.txt"] and (cfg.data.batch_size, cfg.data.seq_len) == (4, 64)
    # the same through `base:`
    based = tmp_path / "based.yaml"
    based.write_text(f"base: {ROOT / 'configs' / 'tiny.yaml'}\n" + mine.read_text())
    assert C.load(based) == cfg


def test_errors_in_composed_files_name_the_file_and_line(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("optim:\n  learning_rate: 1e-3\n")
    b = tmp_path / "b.yaml"
    b.write_text("data:\n  seq_len: 64\noptim:\n  warmup_steps: 5\n  learing_rate: 1e-3\n")
    with pytest.raises(C.ConfigError) as e:
        C.load([a, b])
    assert str(e.value) == (f"config: {b}:5: unknown key 'optim.learing_rate' "
                            f"(did you mean 'optim.learning_rate'?)")
    c = tmp_path / "c.yaml"
    c.write_text(f"base: {b.name}\n")
    b.write_text("data:\n  train:\n    - a.txt\n    - [nested]\n")
    with pytest.raises(C.ConfigError) as e:
        C.load([a, c])  # the base's own line, though the file given was c.yaml
    assert str(e.value).startswith(f"config: {b}:4: data.train[1] must be a str"), str(e.value)
    b.write_text("train:\n  steps: many\n")
    a.write_text("optim:\n  b1: 0.9\nbase: b.yaml\n")  # base may come after the keys
    with pytest.raises(C.ConfigError, match=rf"^config: {b}:2: train.steps must be an int, got 'many'$"):
        C.load(a)
    d = tmp_path / "d.yaml"
    d.write_text("base: missing.yaml\n")
    with pytest.raises(FileNotFoundError, match=rf"config: {d}:1: base file not found: {tmp_path}/missing.yaml"):
        C.load(d)
    d.write_text("base: {a: 1}\n")
    with pytest.raises(C.ConfigError, match=rf"config: {d}:1: base must be a path"):
        C.load(d)


def test_a_cycle_of_bases_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from dsjax.cli import run_main
    from dsjax.train.__main__ import main as train_main
    (tmp_path / "x").mkdir()
    one, two, three = tmp_path / "one.yaml", tmp_path / "x" / "two.yaml", tmp_path / "three.yaml"
    one.write_text("base: x/two.yaml\noptim:\n  b1: 0.8\n")
    two.write_text("base: ../three.yaml\n")
    three.write_text("base: [one.yaml]\n")
    with pytest.raises(C.ConfigError) as e:
        C.load(one)
    assert str(e.value) == f"config: base files form a cycle: {one} -> {two} -> {three} -> {one}"
    self_ref = tmp_path / "self.yaml"
    self_ref.write_text("base: self.yaml\n")
    with pytest.raises(C.ConfigError, match="cycle"):
        C.load(self_ref)
    run = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["python -m dsjax.train", "--config", str(ROOT / "configs" / "tiny.yaml"),
                                      "--config", str(two), "--set", f"train.run_dir={run}"])
    with pytest.raises(SystemExit) as ex:
        run_main("dsjax.train", train_main)
    err = capsys.readouterr().err
    assert ex.value.code == 2 and err.count("\n") == 1, err
    assert err == f"dsjax.train: error: config: base files form a cycle: {two} -> {three} -> {one} -> {two}\n"
    assert not run.exists()


# --- Pallas kernels: routed rows for the grouped GEMM; interpret mode's CPU threads ----------------

MOE_PALLAS = ["model.moe_impl=pallas", "model.dtype=bfloat16", "model.moe_intermediate_size=128"]


def test_moe_pallas_with_fewer_rows_than_the_kernel_tile_is_refused(tmp_path, monkeypatch, capsys):
    from dsjax.cli import run_main
    from dsjax.train.__main__ import main as train_main
    tiny = ROOT / "configs" / "tiny.yaml"
    with pytest.raises(C.ConfigError) as e:
        C.load(tiny, MOE_PALLAS + ["data.batch_size=1", "data.seq_len=32"])
    msg = str(e.value)
    assert msg == ("config: model.moe_impl=pallas: the grouped-GEMM kernel needs at least 128 routed rows, "
                   "and data.batch_size=1 x data.seq_len=32 x model.num_experts_per_tok=2 give 64; use "
                   "data.batch_size x data.seq_len >= 64 or model.moe_impl=auto"), msg
    with pytest.raises(C.ConfigError, match=r"x model.num_experts_per_tok=3 give 123; .* >= 43 or"):
        C.load(tiny, MOE_PALLAS + ["data.batch_size=1", "data.seq_len=41", "model.num_experts_per_tok=3"])
    for sets in (["data.batch_size=1", "data.seq_len=64"], ["data.batch_size=2", "data.seq_len=32"],
                 ["data.batch_size=1", "data.seq_len=43", "model.num_experts_per_tok=3"],  # 129 rows
                 ["data.batch_size=1", "data.seq_len=32", "model.moe_impl=auto"],
                 ["data.batch_size=1", "data.seq_len=32", "model.first_k_dense_replace=4"]):  # no MoE layer
        C.load(tiny, MOE_PALLAS + sets)
    # through the command: one line, exit 2, no run directory
    run = tmp_path / "run"
    argv = ["python -m dsjax.train", "--config", str(tiny)]
    for s in MOE_PALLAS + ["data.batch_size=1", "data.seq_len=32", f"train.run_dir={run}"]:
        argv += ["--set", s]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as ex:
        run_main("dsjax.train", train_main)
    assert ex.value.code == 2 and capsys.readouterr().err == f"dsjax.train: error: {msg}\n"
    assert not run.exists()


def test_moe_pallas_rows_per_device_are_checked_before_the_run_dir(tmp_path):
    """On the tests' 8 CPU devices the default fsdp mesh splits the batch 8 ways: 512 routed rows
    in all are 64 per device."""
    import jax

    from dsjax.train import loop
    assert jax.device_count() == 8
    tiny = ROOT / "configs" / "tiny.yaml"
    cfg = C.load(tiny, MOE_PALLAS + ["data.batch_size=8", "data.seq_len=32", f"train.run_dir={tmp_path}/run"])
    with pytest.raises(C.ConfigError) as e:
        loop.train(cfg)
    msg = str(e.value)
    assert ("needs at least 128 routed rows per device, and data.batch_size=8 x data.seq_len=32 x "
            "model.num_experts_per_tok=2 = 512, split over 8 token shards (x expert=1) of mesh" in msg
            and "give 64 per device; use data.batch_size x data.seq_len >= 512 or model.moe_impl=auto" in msg), msg
    assert "\n" not in msg and not (tmp_path / "run").exists()
    loop.setup_parallel(C.load(tiny, MOE_PALLAS + ["data.batch_size=8", "data.seq_len=64"]))
    # expert parallelism: each rank computes the rows of the tokens of its 2-rank expert group
    loop.setup_parallel(C.load(tiny, MOE_PALLAS + ["data.batch_size=8", "data.seq_len=32", "mesh.preset=ep",
                                                   "mesh.expert=2"]))
    with pytest.raises(C.ConfigError, match=r"= 256, split over 8 token shards \(x expert=2\) .* give 64 per device; use "
                                            r"data.batch_size x data.seq_len >= 256"):
        loop.setup_parallel(C.load(tiny, MOE_PALLAS + ["data.batch_size=8", "data.seq_len=16", "mesh.preset=ep",
                                                       "mesh.expert=2"]))


def test_plan_composes_config_files_and_names_a_bad_one(tmp_path):
    """`python -m dsjax.plan` takes --config more than once too; a bad key in the second file is
    one line naming FILE:LINE, exit status 2 (the planning child's error, passed on)."""
    import os
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  seq_len: 64\ntrain:\n  stepz: 3\n")
    env = {k: v for k, v in os.environ.items() if k != "DSJAX_PLAN_CHILD"}
    r = subprocess.run([sys.executable, "-m", "dsjax.plan", "--config", str(ROOT / "configs" / "tiny.yaml"),
                        "--config", str(bad), "--devices", "1"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr == (f"dsjax.plan: error: config: {bad}:4: unknown key 'train.stepz' "
                        f"(did you mean 'train.steps'?)\n"), r.stderr[-2000:]
