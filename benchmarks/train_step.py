"""Training-step throughput at DeepSeek-V2-Lite geometry, dsjax vs HF transformers, one table.

    python benchmarks/train_step.py [--layers 4] [--batch 4] [--seq 2048] [--steps 10] [--peers hf]
        [--mesh preset=ep expert=4 ...] [--set model.KEY=VALUE ...]

Model: vocab 102400, hidden 2048, 16 heads, no q LoRA, kv_lora_rank 512, nope/rope/v 128/64/128,
64 routed experts top-6, 2 shared, moe_intermediate 1408, intermediate 10944,
first_k_dense_replace 1; bf16 compute, fp32 master weights, AdamW (`--set` overrides any of it
for dsjax only). dsjax runs its step as `python -m dsjax.train` does (dsjax.train.loop): a mesh
over every device (`--mesh` takes `mesh.*` config keys; default fsdp over all devices, ZeRO-3),
the state created in its sharded layout, the batch sharded per the rules preset, the step jitted
with those shardings and donated state under the sharding context; global batch = batch x
devices. The HF peer (transformers DeepseekV2ForCausalLM, bf16 autocast over fp32 weights, or
bf16 weights; fused AdamW) runs in a subprocess on one GPU, eager or torch.compile.
`--breakdown` also times dsjax's forward and forward+backward alone (same mesh);
`--profile DIR` traces three more steps and prints the device time of the top ops.
Prints the mesh and the largest parameter's sharding, the first step's loss, then tokens/s per
device and TFLOP/s per device (6 x active params + attention FLOPs per token).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback

V2_LITE = ["model.vocab_size=102400", "model.hidden_size=2048", "model.num_attention_heads=16",
           "model.q_lora_rank=null", "model.kv_lora_rank=512", "model.qk_nope_head_dim=128",
           "model.qk_rope_head_dim=64", "model.v_head_dim=128", "model.n_routed_experts=64",
           "model.num_experts_per_tok=6", "model.n_shared_experts=2", "model.moe_intermediate_size=1408",
           "model.intermediate_size=10944", "model.first_k_dense_replace=1", "model.topk_method=greedy",
           "model.scoring_func=softmax", "model.norm_topk_prob=false", "model.n_group=1",
           "model.topk_group=1", "model.routed_scaling_factor=1.0", "model.dtype=bfloat16",
           "model.max_position_embeddings=163840",
           "model.rope_scaling={factor: 40, original_max_position_embeddings: 4096, mscale: 0.707, mscale_all_dim: 0.707}"]


def _mesh_sets(mesh: list[str]) -> list[str]:
    """`--mesh preset=ep expert=4` -> ["mesh.preset=ep", "mesh.expert=4"] (a `mesh.` prefix is optional)."""
    return [s if s.startswith("mesh.") else f"mesh.{s}" for s in mesh]


def run_dsjax(args) -> dict:
    """The dsjax train step as `python -m dsjax.train` runs it (dsjax.train.loop): mesh and rules
    preset of `cfg.mesh` (setup_parallel), the state created in its sharded layout (create_state),
    the batch placed per the rules (global_batch), the step jitted with those shardings, donated
    state and traced under the sharding context (jit_train_step)."""
    import jax
    import numpy as np

    import dsjax  # noqa: F401
    from dsjax import config as C
    from dsjax.train.loop import create_state, global_batch, jit_eval_step, jit_train_step, setup_parallel
    from dsjax.train.metrics import flops_per_token
    from dsjax.train.optim import build_optimizer
    from dsjax.train.step import init_model, make_eval_step
    from sharding import rules as shr

    sets = V2_LITE + [f"model.num_hidden_layers={args.layers}", f"data.seq_len={args.seq}",
                      f"model.remat={args.remat}", f"model.attention_impl={args.attention_impl}",
                      f"model.moe_impl={args.moe_impl}"] + args.set + _mesh_sets(args.mesh)
    mc = C.load(None, sets).mesh  # the mesh's device count sets the global batch
    n_dev = jax.device_count() if mc.devices == -1 else mc.devices
    cfg = C.load(None, sets + [f"data.batch_size={args.batch * n_dev}"])
    par = setup_parallel(cfg)
    n_dev = par.mesh.size
    fns, params, rest = init_model(cfg)
    tx, sched = build_optimizer(cfg.optim, 1000)
    state, sh = create_state(fns, params, rest, tx, par)
    del params, rest
    step = jit_train_step(cfg, fns, tx, sched, par, sh)
    A, B, T = cfg.train.grad_accum, cfg.data.batch_size, args.seq
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.model.vocab_size, size=(A * B, T + 1)).astype(np.int32)
    local = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": np.ones((A * B, T), np.float32),
             "segment_ids": np.ones((A * B, T), np.int32),
             "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (A * B, T))}
    batch = global_batch(par, local, A)  # [A, B, T], batch over the data axes, T over context
    mesh_desc = " ".join(f"{a}={n}" for a, n in par.mesh.shape.items())
    big = max(jax.tree_util.tree_leaves_with_path(state["params"]), key=lambda kv: kv[1].size)
    shown = [("/".join(str(getattr(k, "key", k)) for k in big[0]), big[1])]
    experts = state["params"].get("moe_layers", {}).get("mlp", {}).get("gate_proj")
    if experts is not None and experts is not big[1]:
        shown.append(("moe_layers/mlp/gate_proj", experts))
    print(f"dsjax: mesh {mesh_desc} ({n_dev} devices), preset {par.rules.name}; global batch {A} x {B} x {T} "
          f"{batch['inputs'].sharding.spec}; " + "; ".join(
              f"{name} {x.shape} {x.sharding.spec} shard {x.addressable_shards[0].data.shape}" for name, x in shown)
          + f"; {len(shr.replicated_params(sh['params'], state['params']))} params replicated", flush=True)
    breakdown = {}
    if args.breakdown:  # forward alone and forward+backward alone (no optimizer), same model and mesh
        mb = global_batch(par, {k: v[:B] for k, v in local.items()})  # one micro-batch [B, T]
        fwd = jit_eval_step(cfg, fns, par, sh)
        eval_step = make_eval_step(cfg, fns)

        def loss(p, r, b):
            with shr.use_sharding(par.ctx):
                return eval_step(p, r, b)[0] / (B * T)

        fwd_bwd = jax.jit(jax.grad(loss), in_shardings=(sh["params"], sh["rest"], None),
                          out_shardings=sh["params"])
        for name, fn in (("fwd_ms", fwd), ("fwd_bwd_ms", fwd_bwd)):
            jax.block_until_ready(fn(state["params"], state["rest"], mb))
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = fn(state["params"], state["rest"], mb)
            jax.block_until_ready(out)
            breakdown[name] = (time.perf_counter() - t0) / args.steps * 1e3
            del out
    t0 = time.perf_counter()
    state, m = step(state, batch)
    first_loss = float(m["loss"])
    compile_s = time.perf_counter() - t0
    print(f"dsjax: first step loss {first_loss:.6f} (compile + run {compile_s:.1f} s)", flush=True)
    state, m = step(state, batch)
    jax.block_until_ready(m["loss"])
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, m = step(state, batch)
    jax.block_until_ready(m["loss"])
    dt = (time.perf_counter() - t0) / args.steps
    if args.profile:
        n_prof = 3
        jax.profiler.start_trace(args.profile)
        for _ in range(n_prof):
            state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        jax.profiler.stop_trace()
        print_profile(args.profile, n_prof, args.profile_top)
    tps = A * B * T / dt
    ftok = flops_per_token(cfg.model, T)
    return {"impl": f"dsjax attn={args.attention_impl} moe={args.moe_impl} remat={args.remat}",
            "devices": n_dev, "mesh": dict(par.mesh.shape), "preset": par.rules.name,
            "dtype": cfg.model.dtype, "step_ms": dt * 1e3, "tokens_per_s_per_device": tps / n_dev,
            "tflops_per_device": tps * ftok / n_dev / 1e12, "compile_s": compile_s,
            "first_loss": first_loss, "loss": float(m["loss"]), "device": jax.devices()[0].device_kind,
            **breakdown}


def print_profile(trace_dir: str, n_steps: int, top: int, plane_prefix: str = "/device:GPU") -> None:
    """Print the device time of a jax.profiler trace of `n_steps` steps, per step: busy time of
    each GPU plane and its top `top` ops (the "XLA Ops" line where the trace has one, else the
    kernels on all stream lines), in ms per step."""
    import collections
    import glob

    from jax.profiler import ProfileData

    paths = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))
    if not paths:
        print(f"profile: no .xplane.pb under {trace_dir}")
        return
    pd = ProfileData.from_file(paths[-1])
    for plane in pd.planes:
        if not plane.name.startswith(plane_prefix):
            continue
        lines = list(plane.lines)
        print(f"\nprofile {plane.name}: lines " + ", ".join(
            f"{ln.name} ({sum(ev.duration_ns for ev in ln.events) / 1e6 / n_steps:.1f} ms/step)"
            for ln in lines))
        ops = ([ln for ln in lines if ln.name == "XLA Ops"] or [ln for ln in lines if "Stream" in ln.name]
               or [ln for ln in lines if ln.name not in ("XLA Modules", "Steps")])
        per = collections.Counter()
        count = collections.Counter()
        for ln in ops:
            for ev in ln.events:
                per[ev.name] += ev.duration_ns
                count[ev.name] += 1
        total = sum(per.values())
        print(f"{'op':<70} {'ms/step':>8} {'%':>6} {'calls/step':>10}")
        for name, ns in per.most_common(top):
            print(f"{name[:70]:<70} {ns / 1e6 / n_steps:>8.2f} {100 * ns / total:>6.1f} {count[name] / n_steps:>10.1f}")
        print(f"{'total':<70} {total / 1e6 / n_steps:>8.2f}")


HF_SCRIPT = r"""
import json, sys, time, torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
L, B, T, steps, compile_, bf16 = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                  sys.argv[5] == "1", sys.argv[6] == "1")
cfg = DeepseekV2Config(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=L, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
    num_experts_per_tok=6, first_k_dense_replace=1, topk_method="greedy", max_position_embeddings=163840,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})
model = DeepseekV2ForCausalLM(cfg).cuda()
if bf16:  # bf16 weights and Adam state, no autocast
    model = model.to(torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
x = torch.randint(0, 102400, (B, T + 1), device="cuda")
def step():
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not bf16):
        loss = model(input_ids=x[:, :-1], labels=x[:, 1:]).loss
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    return loss
if compile_:
    step = torch.compile(step)
for _ in range(3): step()
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(steps): l = step()
torch.cuda.synchronize(); dt = (time.perf_counter() - t0) / steps
print(json.dumps({"impl": "HF transformers " + ("torch.compile" if compile_ else "eager")
                  + (", bf16 weights" if bf16 else ", autocast fp32 weights"), "devices": 1,
                  "step_ms": dt * 1e3, "tokens_per_s_per_device": B * T / dt, "loss": float(l)}))
"""


def run_hf(args, compile_: bool, bf16: bool) -> dict:
    r = subprocess.run([sys.executable, "-c", HF_SCRIPT, str(args.layers), str(args.batch), str(args.seq),
                        str(args.steps), "1" if compile_ else "0", "1" if bf16 else "0"],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        return {"impl": f"HF transformers {'torch.compile' if compile_ else 'eager'}"
                        f"{' bf16' if bf16 else ''}", "error": r.stderr[-300:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="rows per device")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--remat", default="none")
    p.add_argument("--attention-impl", default="auto")
    p.add_argument("--moe-impl", default="auto")
    p.add_argument("--peers", default="", help="comma list: hf, hf_bf16, hf_compile, hf_compile_bf16")
    p.add_argument("--mesh", nargs="*", default=[], metavar="KEY=VALUE",
                   help="mesh.* config overrides, e.g. preset=ep expert=4 (axes data/fsdp/expert/tensor/"
                        "context, -1 fills the rest; preset dp/fsdp/tp/ep/cp/fsdp_tp_ep/fsdp_ep_cp/all; "
                        "devices=N uses the first N devices); default: fsdp over all devices")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                   help="more dsjax config overrides after the V2-Lite ones, e.g. model.vocab_size=512 "
                        "(dsjax only: the HF peers keep V2-Lite geometry)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time dsjax forward and forward+backward alone (same mesh and shardings)")
    p.add_argument("--profile", default="", help="trace 3 more dsjax steps into this folder and print device time per op")
    p.add_argument("--profile-top", type=int, default=30)
    args = p.parse_args()
    rows = []
    for peer in [x for x in args.peers.split(",") if x]:  # peers first: JAX preallocates GPU memory
        if peer not in ("hf", "hf_bf16", "hf_compile", "hf_compile_bf16"):
            p.error(f"--peers: unknown peer {peer!r}")
        rows.append(run_hf(args, compile_="compile" in peer, bf16=peer.endswith("bf16")))
    try:
        rows.insert(0, run_dsjax(args))
    except Exception as e:  # report, keep the peers' rows
        traceback.print_exc()
        rows.insert(0, {"impl": "dsjax", "error": f"{type(e).__name__}: {str(e)[:300]}"})
    d = rows[0]
    mesh = (f"mesh {' x '.join(f'{a}={n}' for a, n in d['mesh'].items() if n > 1) or '1 device'}, "
            f"preset {d['preset']}" if "mesh" in d else "mesh ?")
    print(f"\nV2-Lite geometry{' + ' + ' '.join(args.set) if args.set else ''}, {args.layers} layers, "
          f"batch {args.batch} x {args.seq} per device, {d.get('dtype', 'bfloat16')}; dsjax {mesh}")
    print(f"{'impl':<56} {'dev':>4} {'step ms':>9} {'tok/s/dev':>11} {'TFLOP/s/dev':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:<56} ERROR {r['error']}")
            continue
        tf = f"{r['tflops_per_device']:.0f}" if "tflops_per_device" in r else "-"
        print(f"{r['impl']:<56} {r['devices']:>4} {r['step_ms']:>9.1f} {r['tokens_per_s_per_device']:>11,.0f} {tf:>12}")
        if "fwd_ms" in r:
            print(f"  dsjax breakdown: forward {r['fwd_ms']:.1f} ms, forward+backward {r['fwd_bwd_ms']:.1f} ms, "
                  f"rest of the step (optimizer, checks) {r['step_ms'] - r['fwd_bwd_ms']:.1f} ms")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
