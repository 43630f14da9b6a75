"""model.fp8=blockwise under the mesh presets (8 fake CPU devices): the dense FP8 linear inside
`shard_map` (`sharding.fp8_linear`) against one device, alone and in training steps, and the
Mosaic backend seeing per-device shapes.

Why the tolerances differ by preset. FP8 rounds each element to 3 mantissa bits with a scale per
128-element tile, so an fp32-rounding difference in a GEMM's input moves an element across an
E4M3 rounding boundary now and then (one E4M3 step is 6-12 % of it) and shifts a tile's scale
when it moves its amax. Layouts that only split tokens (dp, fsdp, ep) compute every activation
bit for bit as one device: their step-1 gradients agree to fp32 rounding (4.7e-7 measured). Tensor
parallelism (the row-parallel psum) and ring attention sum in another order, and FP8 magnifies
those fp32 differences: their step-1 gradients differ by 0.7-1.1 % (relative norm, worst
parameter, measured) where the unquantised run differs from the FP8 run by 10 %. With
`mesh.cp_layout=striped` the wgrad's 128-token tiles group other tokens than one device's
(`sharding.fp8_linear` docstring): 4.1 % measured. A single linear has no upstream rounding, so
there every preset agrees to fp32 rounding."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.fp8 import api as fp8_api
from pallas_kernels.fp8 import reference as R
from sharding import rules as shr
from pallas_kernels.fp8.frozen import Fp8Weight, fp8_linear_frozen
from sharding.fp8_linear import fp8_linear_from_context, fp8_linear_frozen_from_context, tiles_align
from sharding.mesh import make_mesh

sys.path.insert(0, str(Path(__file__).parent))
from sharding_common import run_layout, tiny_cfg  # noqa: E402

# dense layers only (the routed experts' FP8 GEMMs run in `expert_parallel`'s shard_map, whose
# wgrad tiles hold one device's tokens of an expert); widths that split into whole 128-wide
# tiles over tensor=2 (o_proj input 256, kv_b / query output 512, MLP 256); 256 tokens per row,
# so a context=2 split keeps whole 128-token tiles
WIDE = ["model.num_attention_heads=4", "model.qk_nope_head_dim=64", "model.qk_rope_head_dim=64",
        "model.v_head_dim=64", "model.intermediate_size=256", "model.moe_intermediate_size=256",
        "model.first_k_dense_replace=2", "data.seq_len=256"]
FP8 = ["model.fp8=blockwise"]

PRESETS = {  # preset -> mesh of 8 devices that gives each of its axes work
    "dp": dict(data=8), "fsdp": dict(data=2, fsdp=4), "tp": dict(fsdp=4, tensor=2),
    "ep": dict(fsdp=2, expert=4), "cp": dict(fsdp=4, context=2),
    "fsdp_tp_ep": dict(fsdp=2, tensor=2, expert=2), "fsdp_ep_cp": dict(fsdp=2, expert=2, context=2),
    "all": dict(expert=2, tensor=2, context=2),
}


def _mesh(sizes):
    class M:
        data = fsdp = expert = tensor = context = 1
    for k, v in sizes.items():
        setattr(M, k, v)
    return make_mesh(M(), jax.devices()[:int(np.prod(list(sizes.values())))])


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("preset", ["fsdp", "tp", "cp", "all"])  # every kind of split (token-only
def test_sharded_fp8_linear_matches_one_device(preset):  # presets: fsdp; the rest: their axes in "all")
    """Column- and row-parallel weights (("embed", "mlp") [256, 512], ("mlp", "embed")
    [256, 128]) under each kind of split, and a column split that would cut a 128-wide tile ([256,
    384] over tensor=2: 192 a shard, kept whole): y, dx and dw of the shard_map'd linear equal
    `fp8_linear`'s on one device to fp32 rounding (the FP8 error itself, vs fp32, is ~3.5 %)."""
    mesh = _mesh(PRESETS[preset])
    ctx = shr.ShardingContext(mesh, shr.get_rules(preset))
    ks = jax.random.split(jax.random.key(hash(preset) % 1000), 4)
    x = jax.random.normal(ks[0], (8, 256, 256))
    x = jax.device_put(x, ctx.sharding(("batch", "seq", None), x.shape, strict=False))
    cases = [(("embed", "mlp"), 512), (("mlp", "embed"), 128)]
    if "tensor" in PRESETS[preset]:
        cases.append((("embed", "mlp"), 384))
    for axes, n in cases:
        w = jax.random.normal(ks[1], (256, n)) * 0.05
        r = jax.random.normal(ks[2], (8, 256, n))

        def loss(fn):
            return lambda x, w: jnp.sum(fn(x, w) * r)  # noqa: B023
        ours = lambda x, w: fp8_linear_from_context(x, w, axes, ctx=ctx, impl="reference")  # noqa: B023,E731
        one = lambda x, w: fp8_api.fp8_linear(x, w, impl="reference")  # noqa: E731
        assert "shard_map" in str(jax.make_jaxpr(ours)(x, w))
        got = jax.jit(lambda x, w: (ours(x, w),) + jax.grad(loss(ours), (0, 1))(x, w))(x, w)  # noqa: B023
        xh = jnp.asarray(np.asarray(x))  # on one device
        want = (one(xh, w),) + jax.grad(loss(one), (0, 1))(xh, w)
        exact = (xh @ w, r @ w.T, jnp.einsum("btk,btn->kn", xh, r))
        for name, a, b, e in zip(("y", "dx", "dw"), got, want, exact):
            assert a.shape == b.shape
            assert _rel(a, b) < 1e-5, (preset, axes, name, _rel(a, b))
            assert 0.01 < _rel(b, e) < 0.05  # it is FP8: far from fp32, which the 1e-5 would miss


@pytest.mark.parametrize("preset", ["fsdp", "all"])
def test_sharded_frozen_fp8_linear_matches_one_device(preset):
    """A LoRA run's frozen FP8 weight (q e4m3 + 128 x 128 scales, as DeepSeek-V3 ships) under the
    token-only split (fsdp) and under expert x tensor x context ("all": column and row shards of
    q with their scale blocks): y and dx inside shard_map equal `fp8_linear_frozen` on one
    device to fp32 rounding."""
    mesh = _mesh(PRESETS[preset])
    ctx = shr.ShardingContext(mesh, shr.get_rules(preset))
    ks = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(ks[0], (8, 256, 256))
    x = jax.device_put(x, ctx.sharding(("batch", "seq", None), x.shape, strict=False))
    xh = jnp.asarray(np.asarray(x))
    for axes, n in ((("embed", "mlp"), 512), (("mlp", "embed"), 128)):
        w = Fp8Weight(*R.quantize_blocks_128x128(jax.random.normal(ks[1], (256, n)) * 0.05))
        r = jax.random.normal(ks[2], (8, 256, n))
        ours = lambda x: fp8_linear_frozen_from_context(x, w, axes, ctx=ctx, impl="reference")  # noqa: B023,E731
        one = lambda x: fp8_linear_frozen(x, w, impl="reference")  # noqa: B023,E731
        assert "shard_map" in str(jax.make_jaxpr(ours)(x))
        got = jax.jit(lambda x: (ours(x), jax.grad(lambda x: jnp.sum(ours(x) * r))(x)))(x)  # noqa: B023
        want = (one(xh), jax.grad(lambda x: jnp.sum(one(x) * r))(xh))  # noqa: B023
        for name, a, b in zip(("y", "dx"), got, want):
            assert a.shape == b.shape and _rel(a, b) < 1e-5, (preset, axes, name, _rel(a, b))


def test_frozen_mosaic_gemms_see_per_device_operands(monkeypatch):
    """impl="mosaic" under fsdp=2 x tensor=2 ("tp"): a row-parallel frozen weight [256, 128] has
    each device's 2 x 128 tokens and its K shard of 128 with one row of scale blocks; the
    traced kernels are recorded, not run."""
    seen = []

    def rec(a_q, a_s, b_q, b_s, **kw):
        seen.append((tuple(a_q.shape), tuple(b_q.shape), tuple(b_s.shape)))
        return jnp.zeros((a_q.shape[0], b_q.shape[0]), kw.get("out_dtype", jnp.float32))
    monkeypatch.setattr(fp8_api.mosaic_gemm, "fp8_gemm_blockwise", rec)
    mesh = _mesh(dict(fsdp=2, tensor=2))
    ctx = shr.ShardingContext(mesh, shr.get_rules("tp"))
    w = Fp8Weight(*R.quantize_blocks_128x128(jnp.ones((256, 128))))
    x = jnp.ones((4, 64, 256), jnp.bfloat16)
    f = lambda x: fp8_linear_frozen_from_context(x, w, ("mlp", "embed"), ctx=ctx, impl="mosaic")  # noqa: E731
    jax.jit(jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32)))).trace(x)
    # forward: x [2 x 64 tokens, K shard 128] against w^T [N 128, K 128], scales [1, 1]; dgrad:
    # dy [128, N 128] against the same blocks as stored [K 128, N 128]
    assert ((128, 128), (128, 128), (1, 1)) in seen and len(seen) == 2, seen


def test_split_tiles_fall_back_to_the_global_gemm():
    """Rows of 16 tokens over 8 batch shards: a device holds 32 tokens, a quarter of a 128-token
    wgrad tile, so the linear stays out of shard_map (XLA partitions the global GEMM, with one
    device's tiles) and still matches one device; aligned layouts pass `tiles_align`."""
    mesh = _mesh(dict(fsdp=8))
    ctx = shr.ShardingContext(mesh, shr.get_rules("fsdp"))
    assert not tiles_align((16, 16, 32), ("fsdp",), (), mesh)
    assert tiles_align((64, 16, 32), ("fsdp",), (), mesh)  # 8 rows x 16 = 128 tokens
    assert tiles_align((2, 1024, 32), (), ("fsdp",), mesh)  # 128 of each row
    assert not tiles_align((16, 512, 32), (), ("fsdp",), mesh)  # 64 of each row
    ks = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(ks[0], (16, 16, 256))
    w = jax.random.normal(ks[1], (256, 128)) * 0.05
    f = lambda x, w: jnp.sum(fp8_linear_from_context(x, w, ("embed", "mlp"), ctx=ctx, impl="reference") ** 2)  # noqa: E731
    g = lambda x, w: jnp.sum(fp8_api.fp8_linear(x, w, impl="reference") ** 2)  # noqa: E731
    assert "shard_map" not in str(jax.make_jaxpr(f)(x, w))
    for a, b in zip(jax.jit(jax.grad(f, (0, 1)))(x, w), jax.grad(g, (0, 1))(x, w)):
        assert _rel(a, b) < 1e-5


# -------------------------------------------------------------------------- training steps

@pytest.fixture(scope="module")
def one_device():
    """(FP8 run, unquantised run) of 2 steps on one device."""
    devs = jax.devices()[:1]
    return (run_layout(tiny_cfg(*WIDE, *FP8, "mesh.fsdp=1"), steps=2, devices=devs),
            run_layout(tiny_cfg(*WIDE, "mesh.fsdp=1"), steps=2, devices=devs))


def _grad_err(g1, g0):
    """Worst parameter's relative gradient error."""
    return max(_rel(a, b) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)))


TRAIN_LAYOUTS = {  # name -> (mesh settings, bound on step-1 gradient error / FP8-vs-unquantised)
    "all: expert=2 x tensor=2 x context=2 contiguous": (
        ["mesh.preset=all", "mesh.fsdp=1", "mesh.expert=2", "mesh.tensor=2", "mesh.context=2",
         "mesh.cp_layout=contiguous"], 0.2),
    "cp: fsdp=4 x context=2 striped": (["mesh.preset=cp", "mesh.fsdp=4", "mesh.context=2"], 0.6),
}


@pytest.mark.parametrize("name", list(TRAIN_LAYOUTS))
def test_fp8_training_steps_match_one_device(one_device, name):
    """2 AdamW steps with model.fp8=blockwise: step-1 loss as one device's to fp32 rounding; the
    step-1 gradients (same weights, same batch) within the preset's share of the FP8-vs-
    unquantised gap (module docstring: measured 0.11 and 0.40 of it; the token-only layouts'
    step 1 is `test_fp8_grad_accum_matches_one_batch`'s, under data=2 x fsdp=4); the step-2
    gradients and the updated weights closer to one device's FP8 run than the unquantised run
    is (AdamW's first steps move every weight by about the learning rate whatever the size of
    its gradient, which magnifies small differences: measured 0.13-0.63 for the gradients,
    0.03-0.69 for the weights)."""
    (l0, g0, p0, _, _), (ln, gn, pn, _, _) = one_device
    sets, bound = TRAIN_LAYOUTS[name]
    l1, g1, p1, par, _ = run_layout(tiny_cfg(*WIDE, *FP8, *sets), steps=2)
    assert par.mesh.size == 8
    gap = [_grad_err(gn[i], g0[i]) for i in range(2)]
    err = [_grad_err(g1[i], g0[i]) for i in range(2)]
    perr, pgap = _grad_err(p1, p0), _grad_err(pn, p0)
    print(f"\n{name}: losses {l1} vs {l0}; grad err {err} (fp8 vs none {gap}); params {perr:.2e} "
          f"(fp8 vs none {pgap:.2e})")
    assert abs(l1[0] - l0[0]) < 1e-5
    assert gap[0] > 0.05  # FP8 moves the gradients (10 % measured)
    assert err[0] < bound * gap[0]
    assert err[1] < 0.8 * gap[1]
    assert perr < 0.85 * pgap


def _traced_step(cfg):
    """The jaxpr of one train step of cfg under its mesh (traced, not run)."""
    from dsjax.train import loop
    from dsjax.train.optim import build_optimizer
    from dsjax.train.step import init_model, make_train_step
    from sharding_common import synthetic_batches
    par = loop.setup_parallel(cfg)
    fns, params, rest = init_model(cfg)
    tx, schedule = build_optimizer(cfg.optim, cfg.train.steps)
    state, _ = loop.create_state(fns, params, rest, tx, par)
    step = make_train_step(cfg, fns, tx, schedule)
    batch = loop.global_batch(par, synthetic_batches(cfg, 1)[0], 1)

    def traced(s, b):
        with shr.use_sharding(par.ctx):
            return step(s, b)
    return jax.make_jaxpr(traced)(state, batch)


def test_train_step_traces_the_dense_fp8_linears_inside_shard_map():
    """Under fsdp=8 the train step's jaxpr holds two shard_maps (the forward and its transpose)
    per dense FP8 linear (q_a, q_b, kv_a, kv_b, o, gate, up, down in the scanned dense stack)
    more than without FP8 (attention's)."""
    def count(sets):
        cfg = tiny_cfg(*WIDE, "model.num_hidden_layers=1", "model.first_k_dense_replace=1",
                       "mesh.preset=fsdp", "mesh.fsdp=8", *sets)
        return str(_traced_step(cfg)).count("shard_map")
    assert count(FP8) - count([]) == 16


def test_mosaic_kernels_see_per_device_tokens(monkeypatch):
    """With the Mosaic backend the train step under fsdp=4 x tensor=2 hands the kernels each
    device's tokens (2 of the 8 rows of 256: 512, not the global 2048) and each device's tensor
    shard of a weight: the shapes the kernels are traced with (a recording hook; the step is
    traced, not run). Then one row-parallel linear on 4 devices (fsdp=2 x tensor=2) with the
    Mosaic backend's operand layout (padded, transposed), the kernels replaced by stand-ins that
    compute their promoted sums (`reference.gemm_*_reference`, and the quantisation's
references for the fused quantisation kernel; GPU interpret mode's simulator is
    one global state and fails when 4 devices run kernels at once: "Barrier remains allocated"):
    y, dx and dw equal the reference backend's. The kernels themselves are checked against the
    reference on one device in tests/pallas_kernels/fp8/test_fp8_api.py."""
    seen = []
    kernels = {"gemm": fp8_api.mosaic_gemm.fp8_gemm_blockwise, "wgrad": fp8_api.mosaic_wgrad.fp8_gemm_1d1d}

    def hook(name):
        def rec(a_q, a_s, b_q, b_s, **kw):
            seen.append((name, tuple(a_q.shape), tuple(b_q.shape)))
            return kernels[name](a_q, a_s, b_q, b_s, **kw)
        return rec
    monkeypatch.setattr(fp8_api.mosaic_gemm, "fp8_gemm_blockwise", hook("gemm"))
    monkeypatch.setattr(fp8_api.mosaic_wgrad, "fp8_gemm_1d1d", hook("wgrad"))
    resolve = fp8_api.resolve_impl
    monkeypatch.setattr(fp8_api, "resolve_impl", lambda impl: "mosaic" if impl == "auto" else resolve(impl))

    cfg = tiny_cfg(*WIDE, *FP8, "model.num_hidden_layers=1", "model.first_k_dense_replace=1",
                   "mesh.preset=tp", "mesh.fsdp=4", "mesh.tensor=2")
    _traced_step(cfg)
    gemms = [s for s in seen if s[0] == "gemm"]
    wgrads = [s for s in seen if s[0] == "wgrad"]
    assert len(gemms) == 16 and len(wgrads) == 8, seen  # forward + dgrad, wgrad of 8 linears
    # 8 rows x 256 tokens over fsdp=4: 512 tokens a device (tokens are the rows M of the
    # forward / dgrad, the columns of the transposed wgrad operands)
    assert {a[0] for _, a, _ in gemms} == {512}, gemms
    assert {a[1] for _, a, _ in wgrads} == {512}, wgrads
    # o_proj (row-parallel, K = 256 over tensor=2): x [512, 128] and w^T [N 128, K 128]
    assert ("gemm", (512, 128), (128, 128)) in gemms
    # q_b_proj (column-parallel, N = 512 over tensor=2): w^T [N 256, K 128 (q_lora 16, padded)]
    assert ("gemm", (512, 128), (256, 128)) in gemms

    seen.clear()
    kernels.update(gemm=R.gemm_blockwise_reference, wgrad=R.gemm_1d1d_reference)

    def dual_reference(x, *, rows=True, padded=True):  # `quantize_dual`'s padded outputs
        assert padded
        xp = R._pad_to(R._pad_to(x, 0), 1)
        return (R.quantize_rows_1x128(xp) if rows else ()) + R.quantize_cols_128x1_t(xp)
    monkeypatch.setattr(fp8_api.quantize, "quantize_dual", dual_reference)

    def blocks_reference(w, *, padded=True):  # `quantize_blocks_dual`'s padded outputs, 2-d w
        assert padded and w.ndim == 2
        q, s = R.quantize_blocks_128x128(R._pad_to(R._pad_to(w, 0), 1))
        return q, s, q.T, s.T
    monkeypatch.setattr(fp8_api.quantize, "quantize_blocks_dual", blocks_reference)
    mesh = _mesh(dict(fsdp=2, tensor=2))
    ctx = shr.ShardingContext(mesh, shr.get_rules("tp"))
    ks = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(ks[0], (2, 128, 256))
    r = jax.random.normal(ks[2], (2, 128, 128))
    w = jax.random.normal(ks[1], (256, 128)) * 0.05
    out = {}
    for impl in ("mosaic", "reference"):
        f = lambda x, w: fp8_linear_from_context(x, w, ("mlp", "embed"), ctx=ctx, impl=impl)  # noqa: B023,E731
        both = jax.jit(lambda x, w: (f(x, w),) + jax.grad(lambda x, w: jnp.sum(f(x, w) * r), (0, 1))(x, w))  # noqa: B023
        out[impl] = jax.block_until_ready(both(x, w))
    # a device's 128 tokens and K shard of 128: forward x [128, 128], w^T [128, 128]; wgrad
    # x^T [128, 128], dy^T [128, 128]
    assert ("gemm", (128, 128), (128, 128)) in seen and ("wgrad", (128, 128), (128, 128)) in seen, seen
    for a, b in zip(out["mosaic"], out["reference"]):
        assert _rel(a, b) < 1e-5


def test_fp8_grad_accum_matches_one_batch(one_device):
    """train.grad_accum=2 (two micro-batches of 4 rows) under fsdp=4 x data=2 gives the step-1
    loss of one 8-row batch on one device, and its FP8 gradients up to FP8's magnification of
    fp32 rounding: each micro-batch's wgrad tiles are whole rows of 256 tokens, the same tiles
    as the full batch's, but the cotangents reach them scaled per micro-batch and are summed in
    another order (measured: 0.6 % relative, 0.06 of the 10 % FP8-vs-unquantised gap; bound
    0.15 of it)."""
    (l0, g0, _, _, _), (_, gn, _, _, _) = one_device
    cfg = tiny_cfg(*WIDE, *FP8, "mesh.preset=fsdp", "mesh.data=2", "mesh.fsdp=4", "train.grad_accum=2",
                   "data.batch_size=4")
    l1, g1, _, _, _ = run_layout(cfg, steps=1)
    assert abs(l1[0] - l0[0]) < 1e-5
    err, gap = _grad_err(g1[0], g0[0]), _grad_err(gn[0], g0[0])
    print(f"\ngrad_accum=2: loss {l1[0]} vs {l0[0]}; grad err {err:.2e} (fp8 vs none {gap:.2e})")
    assert err < 0.15 * gap
