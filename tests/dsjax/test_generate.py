"""Generation: the MLA latent cache gives the same tokens as full recomputation; sampling rules;
the CLI loads a training run."""
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
    with pytest.raises(FileNotFoundError, match="no checkpoints directory"):
        G.load_run(tmp_path / "nope")
