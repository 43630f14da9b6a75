"""model.fp8=blockwise: config checks, which layers go FP8 and the routed experts with LoRA (the
tiny model trained with and without FP8: tests/benchmarks/test_fp8_loss.py)."""
from pathlib import Path

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax import config as C
from dsjax.model.layers import Linear
from dsjax.model.transformer import DeepSeekModel
from pallas_kernels.fp8 import fp8_grouped_gemm
from pallas_kernels.fp8 import frozen as fp8_frozen
from pallas_kernels.moe import grouped_lora_matmuls
from pallas_kernels.moe.reference import grouped_matmul_reference

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


def test_config_choices_and_tensor_parallel_tiles():
    assert C.load(TINY).model.fp8 == "none"
    assert C.load(TINY, ["model.fp8=blockwise"]).model.fp8 == "blockwise"
    with pytest.raises(C.ConfigError, match=r"^config: model.fp8='fp16': expected one of none, blockwise$"):
        C.load(TINY, ["model.fp8=fp16"])
    # tiny: o_proj's input is 4 heads x 32 = 128 wide; over tensor=2 its shards are 64 wide
    with pytest.raises(C.ConfigError, match=r"model.fp8=blockwise with mesh.tensor=2: model.num_attention_heads "
                                            r"\* v_head_dim \(o_proj input\) = 128 does not split"):
        C.load(TINY, ["model.fp8=blockwise", "mesh.tensor=2", "mesh.fsdp=1", "mesh.preset=tp"])
    wide = ["model.num_attention_heads=8", "model.qk_nope_head_dim=32", "model.qk_rope_head_dim=32",
            "model.v_head_dim=32", "model.intermediate_size=512", "model.moe_intermediate_size=256",
            "model.n_group=1"]
    C.load(TINY, ["model.fp8=blockwise", "mesh.tensor=2", "mesh.fsdp=1", "mesh.preset=tp"] + wide)
    C.load(TINY, ["model.fp8=none", "mesh.tensor=2", "mesh.fsdp=1", "mesh.preset=tp"])


def test_fp8_layers_and_forward():
    """Every attention projection and dense / shared-expert MLP Linear goes FP8, the lm_head
    does not; with the same weights the logits move by FP8 rounding only: each FP8 GEMM's
    output is off by ~3.5 % (tests/pallas_kernels/fp8), and the logits' deviation from their mean
    moved by 6.1 % of its norm at init (measured; bound 10 %); the jaxpr converts to float8_e4m3fn."""
    cfg = C.load(TINY, ["model.fp8=blockwise", "model.num_hidden_layers=2", "model.attention_impl=reference",
                        "model.moe_impl=reference"]).model
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    flags = {".".join(str(p) for p in path): m.fp8 for path, m in nnx.iter_modules(model) if isinstance(m, Linear)}
    assert flags.pop("lm_head") is False
    # per layer 5 attention projections (q_a, q_b, kv_a, kv_b, o) + 3 dense or shared-expert MLP
    assert all(flags.values()) and len(flags) == 16, flags
    names = {k.split(".")[-1] for k in flags}
    assert names == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"}
    base = DeepSeekModel(C.load(TINY, ["model.num_hidden_layers=2", "model.attention_impl=reference",
                                       "model.moe_impl=reference"]).model, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 64), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(64), (2, 64))
    seg = jnp.ones((2, 64), jnp.int32)
    lf, _ = model(tokens, pos, seg)
    lb, _ = base(tokens, pos, seg)
    d = float(jnp.linalg.norm(lf - lb) / jnp.linalg.norm(lb - lb.mean()))
    assert 0 < d < 0.1, d
    jaxpr = str(jax.make_jaxpr(lambda t: model(t, pos, seg)[0])(tokens))
    assert "float8_e4m3fn" in jaxpr


def test_routed_experts_fp8_with_lora_adapters():
    """grouped_lora_matmuls(base_gemm=frozen.grouped_gemm), as the model calls it with model.fp8:
    the base GEMM is fp8_grouped_gemm and the adapter term is added in the compute dtype beside
    it; gradients reach x, W, A and B."""
    ks = jax.random.split(jax.random.PRNGKey(2), 5)
    m, d, f, e, r = 96, 64, 48, 4, 8
    gs = jnp.array([30, 0, 40, 20])
    x = jax.random.normal(ks[0], (m, d))
    w = jax.random.normal(ks[1], (e, d, f)) * 0.05
    a = jax.random.normal(ks[2], (e, d, r)) * 0.1
    b = jax.random.normal(ks[3], (e, r, f)) * 0.1
    cot = jax.random.normal(ks[4], (m, f))

    def ours(x, w, a, b):
        y, = grouped_lora_matmuls(x, (w,), ((a, b),), gs, scale=2.0, impl="reference",
                                base_gemm=fp8_frozen.grouped_gemm)
        return jnp.sum(y * cot)

    def want(x, w, a, b):
        t = grouped_matmul_reference(x, a, gs)
        y = fp8_grouped_gemm(x, w, gs) + grouped_matmul_reference(t, b * 2.0, gs)
        return jnp.sum(y * cot)

    for g1, g2 in zip(jax.grad(ours, (0, 1, 2, 3))(x, w, a, b), jax.grad(want, (0, 1, 2, 3))(x, w, a, b)):
        np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-4, atol=1e-5 * float(jnp.abs(g2).max()))
    with pytest.raises(ValueError, match="base_gemm reads no in_stacks"):
        grouped_lora_matmuls(x, (w,), (None,), gs, scale=1.0, impl="reference", base_gemm=fp8_frozen.grouped_gemm,
                             in_stacks=((w[None], 0),))
    # a W's dw_sink goes to base_gemm as its keyword: W's gradient lands in the ref's rows, W gets none
    def sunk(x, w, a, b):
        ref = jax.new_ref(jnp.zeros((2 * e, d, f), w.dtype))
        gw = jax.grad(lambda w: jnp.sum(grouped_lora_matmuls(
            x, (w,), ((a, b),), gs, scale=2.0, impl="reference", base_gemm=fp8_frozen.grouped_gemm,
            dw_sinks=((ref, e),))[0] * cot))(w)
        return gw, ref[...]
    gw, into = jax.jit(sunk)(x, w, a, b)
    dw = jax.jit(jax.grad(want, 1))(x, w, a, b)
    assert float(jnp.abs(dw).max()) > 0 and not bool(jnp.any(gw != 0)) and not bool(jnp.any(into[:e] != 0))
    np.testing.assert_array_equal(np.asarray(into[e:]), np.asarray(dw))
    with pytest.raises(ValueError, match="frozen Fp8Weight has no gradient"):
        fp8_frozen.grouped_gemm(x, fp8_frozen.Fp8Weight.quantize(w), gs, dw_sink=(jnp.zeros_like(w), 0))
