"""Generation: the MLA latent cache gives the same tokens as full recomputation; sampling rules;
the CLI loads a training run."""
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsjax  # noqa: F401
from dsjax import config as C
from dsjax import generate as G
from dsjax.cli import run_main
from dsjax.data import stdlib_files
from dsjax.model import DeepSeekModel
from dsjax.train import loop

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (0.8, 0.9)])
def test_cache_and_no_cache_give_same_tokens(temperature, top_p):
    cfg = C.ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=3, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=12,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                        num_experts_per_tok=2, first_k_dense_replace=1, initializer_range=0.2)
    m = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    prompt = np.asarray([[5, 17, 3, 42, 8], [1, 2, 3, 4, 5]], np.int32)
    a, _ = G.generate(m, prompt, 24, temperature=temperature, top_p=top_p, seed=3, use_cache=True)
    b, _ = G.generate(m, prompt, 24, temperature=temperature, top_p=top_p, seed=3, use_cache=False)
    assert a.shape == (2, 29)
    np.testing.assert_array_equal(a, b)
    assert len(set(a[0, 5:].tolist())) > 1  # not a degenerate constant sequence


def test_batched_prompts_equal_each_alone_and_stop_per_row():
    cfg = C.ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=3, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=12,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                        num_experts_per_tok=2, first_k_dense_replace=1, initializer_range=0.2)
    m = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, 97, n).astype(np.int32) for n in (7, 3, 5)]
    alone = [G.generate(m, r[None], 12)[0][0] for r in rows]
    ids = np.zeros((3, 7), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    lens = [len(r) for r in rows]
    for opts in ({}, {"kv_cache_dtype": "int8"}, {"use_cache": False}):
        got, _ = G.generate(m, ids, 12, lengths=lens, **opts)
        if not opts:
            for i, r in enumerate(rows):
                np.testing.assert_array_equal(got[i, :len(r) + 12], alone[i])
                assert (got[i, len(r) + 12:] == -1).all()
        else:
            assert got.shape == (3, 19) and (got[0] >= 0).all()
    # EOS: a token that row 1 produces mid-way; each row stops at its first EOS, the rest padded
    eos = int(alone[1][3 + 4])
    got, _ = G.generate(m, ids, 12, lengths=lens, eos_id=eos)
    for i, r in enumerate(rows):
        new = alone[i][len(r):].tolist()
        want = new[:new.index(eos) + 1] if eos in new else new
        row = got[i][got[i] >= 0].tolist()
        assert row == r.tolist() + want
        assert (got[i, len(row):] == -1).all()
    assert got.shape[1] == max(len(r) + len(n) for r, n in zip(rows, [
        (lambda n: n[:n.index(eos) + 1] if eos in n else n)(a[len(r):].tolist()) for r, a in zip(rows, alone)]))


def test_bad_generation_options_exit_2_before_reading_the_run(tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n\n{"text": "b"}\n')
    cases = [(["--prompt", "x", "--sink-tokens", "4"], "sink_tokens (--sink-tokens): needs window"),
             (["--prompt", "x", "--window", "0"], "window (--window): must be at least 1"),
             (["--prompts-file", str(prompts)], f"{prompts}:3: expected an object with a string \"prompt\" field"),
             (["--prompts-file", str(tmp_path / "none.txt")], "--prompts-file not found")]
    for extra, msg in cases:
        monkeypatch.setattr(sys, "argv", ["dsjax.generate", "--checkpoint", str(tmp_path / "no_run"), *extra])
        with pytest.raises(SystemExit) as e:
            run_main("dsjax.generate", G.main)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err == f"dsjax.generate: error: {msg}" or (msg in err and "\n" not in err), err
    assert not (tmp_path / "no_run").exists()


def test_sampling_rules():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    assert int(G.sample_logits(logits, jax.random.key(0), 0.0, 1.0)[0]) == 0
    keys = jax.random.split(jax.random.key(1), 400)
    draws = np.asarray([int(G.sample_logits(logits, k, 1.0, 0.75)[0]) for k in keys[:200]])
    assert set(draws.tolist()) <= {0, 1}  # nucleus 0.75 = {0.5, 0.3}
    assert {0, 1} <= set(draws.tolist())
    draws = np.asarray([int(G.sample_logits(logits, k, 1.0, 0.4)[0]) for k in keys[200:260]])
    assert set(draws.tolist()) == {0}  # always at least the top token


def test_cli_generates_from_a_run(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in stdlib_files():
        if f.name in {"textwrap.py", "bisect.py", "heapq.py"}:
            shutil.copy(f, corpus / f.name)
    cfg = C.load(ROOT / "configs" / "tiny.yaml", [
        f"data.train=[{corpus}/*.py]", f"data.cache_dir={tmp_path}/cache", "data.seq_len=32",
        "data.batch_size=4", "model.vocab_size=300", "model.num_hidden_layers=2",
        f"train.run_dir={tmp_path}/run", "train.steps=2", "train.progress=false", "train.eval_every=100",
        "optim.decay_steps=12"])  # the schedule of test_reliability.py's runs: one train step program
    loop.train(cfg)
    capsys.readouterr()  # drop the training messages
    monkeypatch.setattr(sys, "argv", ["dsjax.generate", "--checkpoint", str(tmp_path / "run"),
                                      "--prompt", "def f(x):", "--max-new-tokens", "8"])
    G.main()
    out = capsys.readouterr().out
    assert out.startswith("def f(x):")
    assert "tokens/s" in out and "checkpoint step 2" in out
    # a prompts file in batches of 2, int8 latent, sinks + window: one JSON line per prompt
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n\nimport os\nclass A:\n")
    monkeypatch.setattr(sys, "argv", ["dsjax.generate", "--checkpoint", str(tmp_path / "run"), "--prompts-file",
                                      str(prompts), "--batch-size", "2", "--max-new-tokens", "6",
                                      "--kv-cache-dtype", "int8", "--window", "8", "--sink-tokens", "2"])
    G.main()
    cap = capsys.readouterr()
    lines = [json.loads(x) for x in cap.out.splitlines()]
    assert [x["prompt"] for x in lines] == ["def f(x):", "import os", "class A:"]
    assert all(x["completion"].startswith(x["prompt"]) and 1 <= x["new_tokens"] <= 6 for x in lines)
    assert "tokens/s" in cap.err and "int8" in cap.err and "2 sinks + window 8" in cap.err
    # cache bytes of a batch of 2: 2 layers x 2 rows x 10 slots x (C int8 + 4-byte scale + R float32)
    c = C.load(ROOT / "configs" / "tiny.yaml", ["model.vocab_size=300", "model.num_hidden_layers=2"]).model
    assert f"{2 * 2 * 10 * (c.kv_lora_rank + 4 + 4 * c.qk_rope_head_dim)} bytes" in cap.err
    with pytest.raises(FileNotFoundError, match="no checkpoints directory"):
        G.load_run(tmp_path / "nope")
