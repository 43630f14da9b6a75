"""DeepSeek-V3's FP8 checkpoint as it ships in a LoRA run under model.fp8=blockwise: frozen
weights loaded as e4m3 + 128x128 scales (a weight and its weight_scale_inv in different shards,
partial edge blocks), their memory, logits at step 0, LoRA training on 1 and 8 fake devices,
checkpoint round trip, and `--to-hf --dtype fp8` export (format, round trip, transformers)."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsjax import config as C
from dsjax.checkpoint import Checkpointer, abstract_like
from dsjax.hf import SafetensorsCheckpoint, load_hf_params, save_hf
from dsjax.hf import mapping as M
from dsjax.hf.export import fp8_quantized
from dsjax.hf.safetensors_io import write_sharded
from dsjax.model.lora import path_names
from dsjax.train import finetune, loop, runs
from dsjax.train.optim import build_optimizer
from dsjax.train.step import checkpointed
from pallas_kernels.fp8 import reference as ref
from pallas_kernels.fp8.frozen import Fp8Weight

import torch  # noqa: E402  the test extra: missing torch/transformers fails loudly, never skips
import transformers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# configs/tiny.yaml is 128 wide: q_lora 64, kv_a 32 + 16 = 48, heads 4 x 48 = 192, experts 96,
# MLP 384: full blocks, partial edge blocks and single partial blocks
BASE = ["model.num_hidden_layers=2", "model.vocab_size=320", "model.attention_impl=reference",
        "model.moe_impl=reference", "model.initializer_range=0.05", "data.seq_len=32", "data.batch_size=4",
        "optim.warmup_steps=0", "optim.learning_rate=1e-2", "train.steps=4"]
LORA = ["model.fp8=blockwise", "lora.rank=8", "lora.alpha=16", "lora.target_modules=[all-linear]"]


def _cfg(*sets):
    return C.load(ROOT / "configs" / "tiny.yaml", BASE + list(sets))


def _quantised_key(k: str, x: np.ndarray) -> bool:
    """DeepSeek-V3's FP8 weights: the 2-D `*_proj` linears of the decoder layers."""
    return x.ndim == 2 and k.startswith("model.layers.") and "_proj" in k


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A DeepSeek-V3-style FP8 checkpoint of a random tiny model: every linear quantised with the
    reference quantiser (e4m3 [out, in] + fp32 weight_scale_inv [ceil(out/128), ceil(in/128)]),
    all weights in one shard and all scales in another. Returns (dir, {key: (q, s)})."""
    root = tmp_path_factory.mktemp("fp8ckpt")
    cfg = _cfg()
    _, params, rest = finetune.init_model(cfg, seed=5)
    save_hf(root / "f32", cfg.model, params, rest, dtype="float32")
    src = SafetensorsCheckpoint(root / "f32")
    d = root / "hf"
    d.mkdir()
    weights, scales, want = {}, {}, {}
    for k in src.keys():
        x = src.read(k)
        if not _quantised_key(k, x):
            weights[k] = x.astype(ml_dtypes.bfloat16) if "mlp.gate." not in k else x
            continue
        q, s = (np.asarray(a) for a in ref.quantize_blocks_128x128(jnp.asarray(x)))
        weights[k], scales[k + "_scale_inv"] = q, s
        want[k] = (q, s)
    assert want["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"][1].shape == (1, 1)  # [48, 128]
    assert want["model.layers.0.mlp.down_proj.weight"][1].shape == (1, 3)  # [128, 384]
    assert want["model.layers.0.self_attn.q_b_proj.weight"][1].shape == (2, 1)  # [192, 64]
    for name, group in (("model-00001-of-00002.safetensors", weights),
                        ("model-00002-of-00002.safetensors", scales)):
        sub = root / (name + ".d")
        write_sharded(sub, [(k, v.dtype, v.shape) for k, v in group.items()], group.__getitem__)
        (sub / "model.safetensors").rename(d / name)
    wm = {k: "model-00001-of-00002.safetensors" for k in weights}
    wm.update({k: "model-00002-of-00002.safetensors" for k in scales})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    hf_cfg = json.loads((root / "f32" / "config.json").read_text())
    hf_cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(hf_cfg))
    return d, want


def _load(cfg, d, keep_fp8=True):
    """(fns, full params, rest) of cfg with its base weights from the HF checkpoint d."""
    fns, params, rest = finetune.init_model(cfg)
    base, adapters = finetune.base_and_adapters(params)
    keep = finetune.fp8_frozen_paths(cfg, params) if keep_fp8 else None
    base, rest = load_hf_params(d, cfg.model, base, rest, fp8_keep=keep)
    return fns, finetune.join(base, adapters), rest


def _leaves(tree):
    return {path_names(p): x for p, x in
            jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, Fp8Weight))[0]}


def test_frozen_weights_load_as_stored_and_take_half_the_memory(ckpt):
    d, want = ckpt
    cfg = _cfg(*LORA)
    fns, params, rest = _load(cfg, d)
    leaves = _leaves(params)
    fp8 = {p for p, x in leaves.items() if isinstance(x, Fp8Weight)}
    assert fp8 == finetune.fp8_frozen_paths(cfg, params)
    names = {p[-2] if p[-1] == "kernel" else p[-1] for p in fp8}
    assert names == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"}
    assert ("moe_layers", "mlp", "gate_proj") in fp8  # routed experts [L, E, in, out]
    assert not isinstance(leaves[("lm_head", "kernel")], Fp8Weight)
    n = 0
    for e in M.entries(cfg.model, params, rest):
        if e.hf not in want:
            continue
        w = M.get_path(params, e.path)
        assert isinstance(w, Fp8Weight), e.hf
        q, s = want[e.hf]
        got_q = np.asarray(w.q[e.index] if e.index else w.q)
        got_s = np.asarray(w.s[e.index] if e.index else w.s)
        np.testing.assert_array_equal(got_q.T.view(np.uint8), q.view(np.uint8), err_msg=e.hf)
        np.testing.assert_array_equal(got_s.T, s, err_msg=e.hf)
        n += 1
    assert n == len(want)
    # the train state's frozen part holds them as they are; bytes ~ half of bf16
    train, frozen = finetune.partition(cfg, params)
    fz = _leaves(frozen)
    kept = [fz[p] for p in fp8]
    assert all(isinstance(x, Fp8Weight) and x.q.dtype == jnp.float8_e4m3fn for x in kept)
    fp8_bytes = sum(x.nbytes for x in kept)
    elems = sum(int(np.prod(x.shape)) for x in kept)
    print(f"frozen FP8 weights: {fp8_bytes} bytes for {elems} elements ({fp8_bytes / elems:.4f} B/elem; "
          f"bf16 {2 * elems} bytes)")
    assert 1.0 < fp8_bytes / elems < 1.02  # 1 byte + 4 per (partial) block; bf16 would be 2
    assert set(_leaves(train)) == {p for p in leaves if p[-1] in ("lora_A", "lora_B")}


def test_logits_at_step_0_match_the_dequantised_model(ckpt):
    """Frozen FP8 (as stored) vs the same checkpoint dequantised to fp32 and run through the FP8
    GEMMs (which re-quantise each weight: the same E4M3 values, scales amax / 448 within an ulp
    of the stored ones; each GEMM agrees to ~3e-7): the logits differ only where an ulp flips
    the E4M3 rounding of an activation downstream, measured 1.5e-3 of the logits' spread (fp32
    compute; 9e-5 in bf16, whose output rounding absorbs most of the ulps), against 0.145 from
    FP8 activation rounding itself (the same checkpoint with fp32 GEMMs, model.fp8=none)."""
    d, _ = ckpt
    cfg = _cfg(*LORA)
    fns, params, rest = _load(cfg, d)
    model = fns.merge(params, rest)  # the other weights in their weight dtype, as below
    fns_d, params_d, rest_d = _load(cfg, d, keep_fp8=False)
    assert not any(isinstance(x, Fp8Weight) for x in _leaves(params_d).values())
    deq = fns_d.merge(params_d, rest_d)  # float32 weights = q * s, re-quantised by fp8_linear
    cfg_none = _cfg("model.fp8=none", *LORA[1:])
    fns_n, params_n, rest_n = _load(cfg_none, d, keep_fp8=False)
    plain = fns_n.merge(params_n, rest_n)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 32), 0, cfg.model.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(32), (2, 32))
    seg = jnp.ones((2, 32), jnp.int32)
    lf, _ = model(tokens, pos, seg)
    ld, _ = deq(tokens, pos, seg)
    lp, _ = plain(tokens, pos, seg)
    spread = float(jnp.linalg.norm(lp - lp.mean()))
    d_deq = float(jnp.linalg.norm(lf - ld)) / spread
    d_plain = float(jnp.linalg.norm(lf - lp)) / spread
    print(f"logits vs dequantised model: FP8 GEMM path {d_deq:.2e}, fp32 GEMMs {d_plain:.2e}")
    assert d_deq < 5e-3 and d_deq < 0.05 * d_plain
    assert 0 < d_plain < 0.25


def _batch(cfg, seed=0):
    """One packed batch [grad_accum * batch, seq_len] of random tokens, two documents a row."""
    rng = np.random.default_rng(seed)
    B, T = cfg.data.batch_size * cfg.train.grad_accum, cfg.data.seq_len
    toks = rng.integers(1, cfg.model.vocab_size, (B, T + 1)).astype(np.int32)
    cut = rng.integers(3, T - 3, (B,))
    idx = np.arange(T)[None]
    first = idx < cut[:, None]
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": np.ones((B, T), np.float32),
            "segment_ids": np.where(first, 1, 2).astype(np.int32),
            "positions": np.where(first, idx, idx - cut[:, None]).astype(np.int32)}


def _train(d, mesh_sets, steps=4):
    cfg = C.load(ROOT / "configs" / "tiny.yaml", BASE + LORA + list(mesh_sets))
    par = loop.setup_parallel(cfg)
    fns, params, rest = _load(cfg, d)
    tx, schedule = build_optimizer(cfg.optim, cfg.train.steps)
    params, frozen = finetune.partition(cfg, params)
    state, sh = loop.create_state(fns, params, rest, tx, par, frozen=frozen)
    step = loop.jit_train_step(cfg, fns, tx, schedule, par, sh)
    batch = _batch(cfg)
    losses, grad_norms = [], []
    for _ in range(steps):  # the same batch: the loss must fall
        state, m = step(state, loop.global_batch(par, batch, cfg.train.grad_accum))
        losses.append(float(m["loss"]))
        grad_norms.append(float(m["grad_norm/adapters"]))
    return cfg, state, sh, losses, grad_norms


@pytest.mark.parametrize("mesh", [("mesh.fsdp=1", "mesh.devices=1"), ("mesh.preset=fsdp", "mesh.fsdp=8")])
def test_lora_steps_with_frozen_fp8_weights(ckpt, tmp_path, mesh):
    d, want = ckpt
    cfg, state, sh, losses, gnorms = _train(d, mesh)
    print(mesh, "losses", losses, "adapter grad norms", gnorms)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05
    assert all(g > 0 for g in gnorms)
    w = state["frozen"]["dense_layers"]["self_attn"]["kv_b_proj"]["kernel"]
    assert isinstance(w, Fp8Weight) and w.q.dtype == jnp.float8_e4m3fn  # untouched by the steps
    q, s = want["model.layers.0.self_attn.kv_b_proj.weight"]
    np.testing.assert_array_equal(np.asarray(w.q[0]).T.view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(w.s[0]).T, s)
    if "mesh.fsdp=8" in mesh:
        ex = sh["frozen"]["moe_layers"]["mlp"]["up_proj"]  # q [1, 8, 128, 96], s [1, 8, 1, 1]
        assert isinstance(ex, Fp8Weight)
        assert "fsdp" in jax.tree.leaves(tuple(ex.q.spec)) and tuple(ex.s.spec) == (None,) * 4
        mlp = sh["frozen"]["dense_layers"]["mlp"]["up_proj"]["kernel"]  # q [1, 128, 384], s [1, 1, 3]
        assert tuple(mlp.q.spec)[1] == "fsdp" and all(a is None for a in mlp.s.spec)
        assert len(state["frozen"]["moe_layers"]["mlp"]["up_proj"].q.sharding.device_set) == 8
    else:  # checkpoint round trip of a state holding Fp8Weights
        ck = Checkpointer(tmp_path / "ck", dataclasses.replace(cfg.checkpoint, async_save=False))
        ck.save(4, checkpointed(state), {}, C.to_dict(cfg))
        ck.wait()
        restored, _, _, step = ck.restore(abstract_like(checkpointed(state)), 4)
        ck.close()
        a, b = _leaves(restored["frozen"]), _leaves(state["frozen"])
        for p in b:
            for x, y in zip(jax.tree.leaves(a[p]), jax.tree.leaves(b[p])):
                assert x.dtype == y.dtype
                np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_train_init_from_hf_keeps_fp8_and_resumes_without_the_checkpoint(ckpt, tmp_path):
    """`train.init_from_hf` of the FP8 checkpoint in a LoRA run: 2 steps, then --resume to 3
    with the HF directory gone (the run's own checkpoint holds the frozen FP8 weights)."""
    import shutil
    from dsjax.data import stdlib_files
    d, want = ckpt
    hf = tmp_path / "hf"
    shutil.copytree(d, hf)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in stdlib_files():
        if f.name in {"textwrap.py", "bisect.py", "heapq.py"}:
            shutil.copy(f, corpus / f.name)
    sets = [f"data.train=[{corpus}/*.py]", "data.validation=[]", "data.val_fraction=0",
            f"data.cache_dir={tmp_path}/cache", f"train.run_dir={tmp_path}/run", "train.progress=false",
            "train.tensorboard=false", "train.log_every=1", "train.eval_every=1000", "checkpoint.every=2",
            f"train.init_from_hf={hf}", "mesh.fsdp=1", "mesh.devices=1"]
    loop.train(_cfg(*LORA, *sets, "train.steps=2"))
    shutil.rmtree(hf)
    loop.train(_cfg(*LORA, *sets, "train.steps=3"), resume=True)
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if "loss" in r]
    assert len(losses) == 3 and np.all(np.isfinite(losses))
    cfg, params, _, step = runs.restore_run(tmp_path / "run")
    assert step == 3
    w = params["moe_layers"]["mlp"]["down_proj"]
    assert isinstance(w, Fp8Weight)
    q, s = want["model.layers.1.mlp.experts.1.down_proj.weight"]
    np.testing.assert_array_equal(np.asarray(w.q[0, 1]).T.view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(w.s[0, 1]).T, s)


# ------------------------------------------------------------------------------------------------
# --to-hf --dtype fp8
# ------------------------------------------------------------------------------------------------

def _check_fp8_format(d: Path):
    hf = json.loads((d / "config.json").read_text())
    assert hf["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    ck = SafetensorsCheckpoint(d)
    n = 0
    for k in ck.keys():
        if k.endswith("_scale_inv"):
            continue
        if fp8_quantized(k):
            o, i = ck.shape(k)
            assert ck.dtype(k) == "F8_E4M3" and ck.dtype(k + "_scale_inv") == "F32", k
            assert ck.shape(k + "_scale_inv") == (-(-o // 128), -(-i // 128)), k
            n += 1
        else:
            want = "F32" if ".mlp.gate." in k else "BF16"
            assert ck.dtype(k) == want and k + "_scale_inv" not in ck, k
    assert n > 20 and any(k.startswith("model.layers.1.mlp.experts.3.") for k in ck.keys())
    return ck


def test_export_fp8_writes_stored_weights_and_round_trips(ckpt, tmp_path):
    """The loaded frozen FP8 weights exported with dtype fp8 are the checkpoint's tensors
    bitwise; a float model exported fp8 imports (dequantising and FP8-frozen) as its quantised
    values; transformers loads the export (on CPU it dequantises) to those values."""
    d, want = ckpt
    cfg = _cfg(*LORA)
    _, params, rest = _load(cfg, d)
    base, _ = finetune.base_and_adapters(params)
    out = save_hf(tmp_path / "again", cfg.model, base, rest, dtype="fp8")
    ck = _check_fp8_format(out)
    for k, (q, s) in want.items():
        np.testing.assert_array_equal(ck.read(k).view(np.uint8), q.view(np.uint8), err_msg=k)
        np.testing.assert_array_equal(ck.read(k + "_scale_inv"), s, err_msg=k)
    # a float model -> fp8 -> import
    fcfg = _cfg()
    _, p0, r0 = finetune.init_model(fcfg, seed=9)
    out2 = save_hf(tmp_path / "fromf32", fcfg.model, p0, r0, dtype="fp8")
    ck2 = _check_fp8_format(out2)
    _, deq, _ = _load(fcfg, out2, keep_fp8=False)
    _, kept, _ = _load(_cfg(*LORA), out2)
    for e in M.entries(fcfg.model, p0, r0):
        if not fp8_quantized(e.hf):
            continue
        w = np.asarray(M.get_path(p0, e.path)[e.index] if e.index else M.get_path(p0, e.path))
        q, s = (np.asarray(a) for a in ref.quantize_blocks_128x128(jnp.asarray(w.T)))
        np.testing.assert_array_equal(ck2.read(e.hf).view(np.uint8), q.view(np.uint8), err_msg=e.hf)
        wq = np.asarray(ref.dequantize_blocks_128x128(jnp.asarray(q), jnp.asarray(s)))
        got = np.asarray(M.get_path(deq, e.path)[e.index] if e.index else M.get_path(deq, e.path))
        np.testing.assert_array_equal(got.T, wq, err_msg=e.hf)
        fw = M.get_path(kept, e.path)
        fq = np.asarray(fw.q[e.index] if e.index else fw.q)
        np.testing.assert_array_equal(fq.T.view(np.uint8), q.view(np.uint8), err_msg=e.hf)
    # transformers (CPU: dequantised to bf16 on load)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out2, dtype=torch.float32)
    sd = hf.state_dict()
    for k in ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.mlp.experts.2.down_proj.weight",
              "model.layers.1.self_attn.o_proj.weight"):
        q, s = ck2.read(k).astype(np.float32), ck2.read(k + "_scale_inv")
        wq = q * np.repeat(np.repeat(s, 128, 0), 128, 1)[:q.shape[0], :q.shape[1]]
        got = sd[k].float().numpy() if k in sd else None
        if got is None:  # transformers v5 keeps the experts fused: [E, 2F, D] / [E, D, F]
            got = sd["model.layers.1.mlp.experts.down_proj"][2].float().numpy()
        np.testing.assert_allclose(got, wq, rtol=2 ** -8, atol=0)


def test_convert_cli_to_hf_fp8(ckpt, tmp_path):
    """`python -m dsjax.convert --to-hf RUN --dtype fp8` of a LoRA run with frozen FP8 weights:
    the merged weights in DeepSeek's layout, the PEFT adapter beside them in bf16."""
    d, _ = ckpt
    cfg = _cfg(*LORA, f"train.run_dir={tmp_path / 'run'}")
    _, params, rest = _load(cfg, d)
    tx, _ = build_optimizer(cfg.optim, 1)
    state = runs.make_state(cfg, params, rest, tx)
    assert isinstance(state["frozen"]["dense_layers"]["mlp"]["gate_proj"]["kernel"], Fp8Weight)
    ck = Checkpointer(tmp_path / "run" / "checkpoints", dataclasses.replace(cfg.checkpoint, async_save=False))
    ck.save(0, state, {}, C.to_dict(cfg))
    ck.wait()
    ck.close()
    r = subprocess.run([sys.executable, "-m", "dsjax.convert", "--to-hf", str(tmp_path / "run"), "--out",
                        str(tmp_path / "hf"), "--dtype", "fp8"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    _check_fp8_format(tmp_path / "hf")
    assert (tmp_path / "hf" / "adapter" / "adapter_model.safetensors").is_file()
    r = subprocess.run([sys.executable, "-m", "dsjax.convert", "--to-hf", str(tmp_path / "run"), "--out",
                        str(tmp_path / "hf2"), "--dtype", "fp4"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "fp8" in r.stderr and not (tmp_path / "hf2").exists()
