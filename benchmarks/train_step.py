"""The training step a user runs, dsjax against HF transformers, at DeepSeek-V2-Lite geometry.

    python benchmarks/train_step.py [--layers 4] [--batch 4] [--seq 2048] [--steps 10]
        [--dsjax default,matched,fp8_default,fp8_matched] [--peers hf,hf_compile] [--profile DIR] [--set KEY=VALUE ...]
        [--paired KEY=VALUE ... [--rounds N]] [--baseline DIR [--rounds N]]

Model: vocab 102400, hidden 2048, 16 heads, no q LoRA, kv_lora_rank 512, nope/rope/v 128/64/128,
64 routed experts top-6, 2 shared, moe_intermediate 1408, intermediate 10944,
first_k_dense_replace 1, bf16 compute. Rows (each in its own process, so peak memory and XLA flags
are its own):

  dsjax default   fp32 master weights, fp32 Adam moments (what `python -m dsjax.train` runs)
  dsjax matched   bf16 weights, bf16 Adam moments and bf16 logits (`model.round_logits`): the
                  numerics the HF bf16 peers train with
  dsjax fp8_default, fp8_matched
                  default / matched with `model.fp8=blockwise`: every linear layer but the
                  lm_head runs its forward, dgrad and wgrad GEMMs in FP8 E4M3 with DeepSeek-V3's
                  1 x 128 / 128 x 128 scales (`pallas_kernels.fp8`, the Mosaic GPU kernels on
                  Hopper), quantisation included in the step
  hf / hf_compile HF transformers DeepseekV2ForCausalLM, bf16 weights (so bf16 AdamW state),
                  fused AdamW, eager or torch.compile; no gradient clipping
  hf_compile_clip hf_compile clipping the gradients' global norm to 1.0 in the compiled step
                  (HF Trainer's default max_grad_norm; dsjax clips at optim.grad_clip_norm 1.0)
  torchtitan      torchtitan 0.3.0's own DeepSeek-V3 model at the same geometry, compiled per
                  block, bf16 weights, fused AdamW, clipping at 1.0 (`torchtitan_step.py` says how)

dsjax runs its step as `dsjax.train.loop` does (mesh over every device, fsdp preset, state created
sharded, step jitted with donated state). Columns: step time, tokens/s, model TFLOP/s and MFU
(6 x active params + causal attention FLOP per token, `dsjax.train.metrics.flops_per_token`,
against 989 TFLOP/s dense bf16), peak device memory (dsjax: the allocator's
`peak_bytes_in_use`; HF: `torch.cuda.max_memory_allocated`), and the ratio to the hf_compile
peer (with hf_compile_clip also run, each dsjax row's ratio to it under the table). Under the
table, per dsjax row: the bytes in use with the state resident, XLA's footprint of one step
(`memory_analysis()`), and the allocator's peak after building the state, after compiling and
after the first step, which say where the row's peak was reached. `--profile DIR` traces three
more dsjax steps and prints each row's device time per part of the step (attention, experts,
dense GEMMs, lm_head + loss, optimizer, ...). Under the table,
each row's median SM clock and power over its timed steps and its energy per step
(`gpu_power.py`, read through NVML): whether the row ran at the GPU's power cap. `--paired
KEY=VALUE ...` runs each dsjax row without and with those overrides back to back (`--rounds` times)
and prints the change, for comparing a variant within one call; `--baseline DIR` does the same with
each dsjax row run first from another source tree (`git worktree add DIR REV`, or a `git archive`
of REV unpacked in DIR), for comparing two commits within one call.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
import traceback
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _step_common import DSJAX_ROWS, HF_V2_LITE_CONFIG, INSTR, V2_LITE, classify, row_label, stack_tables  # noqa: E402
from gpu_power import PowerSampler, describe  # noqa: E402
from step_bytes import by_part, hlo_bytes  # noqa: E402 (the bytes each part moves, from the same HLO)

VOCAB, DENSE_WIDTHS = 102400, (10944, 2 * 1408)


class Peer(NamedTuple):
    compile: bool  # torch.compile the step
    clip: bool  # clip the gradients' global norm to 1.0
    label: str  # the row's name in the table


HF_ROWS = {"hf": Peer(False, False, "HF transformers eager, bf16 weights"),
           "hf_compile": Peer(True, False, "HF transformers torch.compile, bf16 weights"),
           "hf_compile_clip": Peer(True, True, "HF torch.compile, bf16, clip 1.0 (Trainer)")}
TORCHTITAN = Peer(True, True, "torchtitan 0.3.0 DeepSeek-V3, bf16, clip 1.0")  # torchtitan_step.py
PEERS = {**HF_ROWS, "torchtitan": TORCHTITAN}
PEAK_TFLOPS = 989.0  # H100/H200 dense bf16 (datasheet)


def random_batch(vocab: int, B: int, T: int) -> dict:
    """One packed-loader batch [B, T] of random tokens (seed 0), one document per row."""
    import numpy as np
    toks = np.random.default_rng(0).integers(0, vocab, size=(B, T + 1)).astype(np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": np.ones((B, T), np.float32),
            "segment_ids": np.ones((B, T), np.int32),
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))}


def time_steps(compiled, state, batch, warmup: int, steps: int):
    """`warmup` untimed steps, then the mean wall time of `steps` steps (seconds; dispatch is
    asynchronous, so only the end is synchronised), with the GPU's clock, power and energy over
    those steps (`gpu_power.PowerSampler.summary()`, None off a GPU). Returns (state, last
    metrics, seconds, power summary)."""
    import jax
    for _ in range(warmup):
        state, _ = compiled(state, batch)
    jax.block_until_ready(state)
    with PowerSampler() as ps:
        t0 = time.perf_counter()
        for _ in range(steps):
            state, m = compiled(state, batch)
        jax.block_until_ready(m["loss"])
        dt = (time.perf_counter() - t0) / steps
    return state, m, dt, ps.summary()


def describe_memory(mem: dict) -> str:
    """One line from run_dsjax's "memory": where the allocator's peak was reached."""
    f = lambda k: f"{mem[k]:.2f}" if mem.get(k) else "-"  # noqa: E731
    return (f"GB in use with the state {f('state_in_use_gb')}; XLA's step footprint {f('step_gb')}; "
            f"allocator peak after the state {f('state_peak_gb')}, after compiling "
            f"{f('compile_peak_gb')}, after the first step {f('first_step_peak_gb')}")


# -- dsjax -----------------------------------------------------------------------------------
def run_dsjax(args, row: str) -> dict:
    """One dsjax row: the train step as `dsjax.train.loop` builds it, timed over args.steps."""
    import jax

    from dsjax import config as C
    from dsjax.train.loop import create_state, global_batch, jit_train_step, setup_parallel
    from dsjax.train.metrics import flops_per_token
    from dsjax.train.optim import build_optimizer
    from dsjax.train.step import init_model

    sets = V2_LITE + [f"model.num_hidden_layers={args.layers}", f"data.seq_len={args.seq}"]
    sets += DSJAX_ROWS[row] + args.set
    n_dev = jax.device_count()
    cfg = C.load(None, sets + [f"data.batch_size={args.batch * n_dev}"])
    par = setup_parallel(cfg)
    fns, params, rest = init_model(cfg)
    tx, sched = build_optimizer(cfg.optim, 1000)
    state, sh = create_state(fns, params, rest, tx, par, compute_dtype=cfg.model.dtype)
    del params, rest
    step = jit_train_step(cfg, fns, tx, sched, par, sh)
    B, T = cfg.data.batch_size, args.seq
    batch = global_batch(par, random_batch(cfg.model.vocab_size, B, T), 1)
    gb = lambda key: (jax.devices()[0].memory_stats() or {}).get(key, 0) / 1e9 or None  # noqa: E731
    mem = {"state_in_use_gb": gb("bytes_in_use"), "state_peak_gb": gb("peak_bytes_in_use")}
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem["compile_peak_gb"] = gb("peak_bytes_in_use")
    ma = compiled.memory_analysis()
    if ma is not None:  # XLA's footprint of one step: arguments + outputs - aliased + temporaries
        mem["step_gb"] = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
                          + ma.temp_size_in_bytes) / 1e9
    state, m = compiled(state, batch)
    first_loss = float(m["loss"])
    mem["first_step_peak_gb"] = gb("peak_bytes_in_use")
    state, m, dt, gpu = time_steps(compiled, state, batch, 2, args.steps)
    out = {"row": f"dsjax {row}", "devices": n_dev, "step_ms": dt * 1e3,
           "tokens_per_s": B * T / dt / n_dev, "flops_per_token": flops_per_token(cfg.model, T),
           "peak_gb": gb("peak_bytes_in_use"), "memory": mem, "compile_s": compile_s,
           "first_loss": first_loss, "loss": float(m["loss"]), "gpu": gpu}
    if "expert_load_max_over_mean" in m:  # per MoE layer: the busiest expert's rows / the mean
        out["expert_load_max_over_mean"] = [round(float(x), 2) for x in m["expert_load_max_over_mean"]]
    if args.profile:
        out["parts_ms"] = traced_parts(compiled, state, batch, os.path.join(args.profile, row), 3)
    if args.hlo:
        os.makedirs(args.hlo, exist_ok=True)
        with open(os.path.join(args.hlo, f"{row}.hlo.txt"), "w") as f:
            f.write(compiled.as_text())
    return out


# -- per-part device time --------------------------------------------------------------------
def traced_parts(compiled, state, batch, trace_dir: str, n_steps: int) -> dict:
    """Run `n_steps` more steps of the compiled train step under a jax.profiler trace into
    trace_dir and return their `step_parts`. The state is donated, so the caller's `state` is
    used up."""
    import jax
    jax.profiler.start_trace(trace_dir)
    for _ in range(n_steps):
        state, m = compiled(state, batch)
    jax.block_until_ready(m["loss"])
    jax.profiler.stop_trace()
    return step_parts(trace_dir, compiled.as_text(), n_steps)


def step_parts(trace_dir: str, hlo_text: str, n_steps: int) -> dict:
    """Device ms per step per part: the trace's GPU kernels, each mapped through its HLO op
    (the "XLA Ops" line's event name, else a stream event's `hlo_op` stat) to the compiled HLO
    and the Python call chain in its metadata."""
    import glob

    from jax.profiler import ProfileData

    chain = stack_tables(hlo_text)
    instr = {}
    for line in hlo_text.splitlines():
        m = INSTR.match(line)
        if m:
            instr.setdefault(m.group(1), m.group(2))
    paths = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))
    events = {"ops": [], "streams": []}
    for plane in ProfileData.from_file(paths[-1]).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for ln in plane.lines:
            for ev in ln.events:
                if ln.name == "XLA Ops":
                    events["ops"].append((ev.name, ev.duration_ns))
                elif "Stream" in ln.name:
                    stats = dict((k, v) for k, v in ev.stats)
                    events["streams"].append((str(stats.get("hlo_op", ev.name)), ev.duration_ns))
    per, ops, part_of, funcs_of = collections.Counter(), collections.Counter(), {}, {}
    for name, ns in events["ops"] or events["streams"]:
        ops[name] += ns / 1e6 / n_steps
    for name, ms in ops.items():
        text = instr.get(name, "")
        fid = re.search(r"stack_frame_id=(\d+)", text)
        funcs_of[name] = chain(int(fid.group(1))) if fid else []
        part_of[name] = classify(name, text, funcs_of[name])
        per[part_of[name]] += ms
    out = dict(per.most_common())
    out["total"] = sum(per.values())
    out["gb"] = {k: b / 1e9 for k, (b, _) in by_part(hlo_bytes(hlo_text)).items()}
    out["ops"] = {n: round(ms, 4) for n, ms in ops.most_common()}
    # the 100 largest ops: part, result shape and the innermost traced Python functions
    out["op_info"] = {}
    for n, _ in ops.most_common(100):
        out["op_info"][n] = {"part": part_of[n], "shape": instr.get(n, "").split(" ")[0][:80],
                             "funcs": funcs_of[n][:4]}
    return out


def format_parts(label: str, parts: dict, step_ms: float | None = None) -> str:
    """`step_parts`' result (or {"error": ...}) as printed lines: ms per part, with the GB it
    moves per step and their rate (`step_bytes.hlo_bytes`; the rate means HBM bandwidth only for
    the memory-bound parts), and the largest ops. `step_ms`: the traced process's timed step
    with command buffers off, if known."""
    if "error" in parts:
        return f"\n{label}: profile failed: {parts['error']}"
    if not parts.get("ops"):
        return f"\n{label}: the trace holds no GPU kernels (profiles need a GPU)"
    lines = [f"\n{label}: device ms per step by part (total {parts['total']:.1f}; command buffers off: "
             f"step {step_ms or float('nan'):.1f} ms)"]
    gb = parts.get("gb", {})
    lines.append(f"  {'part':<40} {'ms':>7} {'GB':>8} {'TB/s':>6}")
    lines += [f"  {k:<40} {v:>7.2f} {gb.get(k, float('nan')):>8.2f} {gb.get(k, float('nan')) / v if v else float('nan'):>6.2f}"
              for k, v in parts.items() if k not in ("total", "ops", "op_info", "gb")]
    lines.append("  largest ops: " + "; ".join(f"{n} {ms:.2f}" for n, ms in list(parts["ops"].items())[:10]))
    return "\n".join(lines)


# -- HF transformers peers -------------------------------------------------------------------
HF_SCRIPT = r"""
import json, sys, time, torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
L, B, T, steps, compile_ = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
clip = sys.argv[7] == "1"
""" + HF_V2_LITE_CONFIG + r"""
model = DeepseekV2ForCausalLM(cfg).cuda().to(torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
x = torch.randint(0, 102400, (B, T + 1), device="cuda")
def step():
    loss = model(input_ids=x[:, :-1], labels=x[:, 1:]).loss
    loss.backward()
    if clip:  # HF Trainer's default max_grad_norm, as dsjax's optim.grad_clip_norm
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
    return loss
if compile_:
    step = torch.compile(step)
for _ in range(3): step()
sys.path.insert(0, sys.argv[6])
from gpu_power import PowerSampler
torch.cuda.synchronize()
with PowerSampler() as ps:
    t0 = time.perf_counter()
    for _ in range(steps): l = step()
    torch.cuda.synchronize(); dt = (time.perf_counter() - t0) / steps
print(json.dumps({"step_ms": dt * 1e3, "tokens_per_s": B * T / dt, "devices": 1, "loss": float(l),
                  "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "gpu": ps.summary()}))
"""


def run_hf(args, peer: str) -> dict:
    """A peer row (HF transformers, or torchtitan through torchtitan_step.py) in its own process."""
    compile_, clip, label = PEERS[peer]
    here = os.path.dirname(os.path.abspath(__file__))
    if peer == "torchtitan":
        argv = [sys.executable, os.path.join(here, "torchtitan_step.py"), str(args.layers), str(args.batch),
                str(args.seq), str(args.steps)]
    else:
        argv = [sys.executable, "-c", HF_SCRIPT, str(args.layers), str(args.batch), str(args.seq),
                str(args.steps), "1" if compile_ else "0", here, "1" if clip else "0"]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    except subprocess.TimeoutExpired:
        return {"row": label, "error": "timed out"}
    if r.returncode != 0:
        err = "out of memory" if "OutOfMemory" in r.stderr else r.stderr.strip().splitlines()[-1][-200:]
        return {"row": label, "error": err}
    return {"row": label, **json.loads(r.stdout.strip().splitlines()[-1])}


def run_child(args, row: str, profile: bool = False, extra: tuple = (), tree: str = "") -> dict:
    """A dsjax row in its own process (own allocator peak, own XLA flags), with `extra` config
    overrides after --set's. With `profile`, the process traces three steps with XLA's command
    buffers off, so that every kernel is attributed to its HLO op (inside a CUDA graph the trace
    sees one event per graph). `tree`: run the row from this source tree's train_step.py and
    packages instead of this one's (labelled " @ baseline")."""
    script = os.path.join(os.path.abspath(tree), "benchmarks", "train_step.py") if tree else __file__
    cmd = [sys.executable, script, "--child", row, "--layers", str(args.layers), "--batch", str(args.batch),
           "--seq", str(args.seq), "--steps", str(args.steps if not profile else 2)]
    cmd += (["--profile", args.profile] if profile else []) + (["--hlo", args.hlo] if args.hlo and profile else [])
    sets = list(args.set) + list(extra)
    cmd += ["--set", *sets] if sets else []
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.path.abspath(tree) + os.pathsep + env.get("PYTHONPATH", "")
    if profile:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    sys.stderr.write(r.stderr[-3000:] if r.returncode else "")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    label = row_label(row, extra, baseline=bool(tree))
    if r.returncode != 0 or not lines:
        err = "out of memory" if "RESOURCE_EXHAUSTED" in r.stderr else (r.stderr.strip().splitlines() or ["?"])[-1][-200:]
        return {"row": label, "error": err}
    return {**json.loads(lines[-1]), "row": label}


def paired_lines(results: list, rows: list, extra: tuple, baseline: str = "") -> list:
    """Per dsjax row: mean step ms and peak GB without and with the `--paired` overrides over the
    rounds, the change, and each round's change (A, B of one round ran back to back). With
    `baseline` (a tree), A is the row run from that tree and B from this one."""
    out = [f"\npaired: A from {baseline}, B from this tree (rounds run A, B back to back)" if baseline else
           f"\npaired: {' '.join(extra)} (A without, B with; rounds run A, B back to back)"]
    for row in rows:
        a = [r for r in results if r["row"] == row_label(row, baseline=bool(baseline)) and "error" not in r]
        b = [r for r in results if r["row"] == row_label(row, extra) and "error" not in r]
        if not a or len(a) != len(b):
            out.append(f"  {row}: incomplete ({len(a)} A, {len(b)} B runs without errors)")
            continue
        ma, mb = (sum(r["step_ms"] for r in x) / len(x) for x in (a, b))
        per = ", ".join(f"{y['step_ms'] - x['step_ms']:+.1f}" for x, y in zip(a, b))
        pa, pb = a[-1].get("peak_gb"), b[-1].get("peak_gb")
        peak = f"peak {pa:.2f} -> {pb:.2f} GB" if pa and pb else "peak not read"
        out.append(f"  {row}: {ma:.1f} -> {mb:.1f} ms ({mb - ma:+.1f} ms, {(mb - ma) / ma:+.1%}; per round {per}); {peak}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="rows per device")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dsjax", default="default,matched", help=f"comma list of {sorted(DSJAX_ROWS)}")
    p.add_argument("--peers", default="hf,hf_compile", help=f"comma list of {sorted(PEERS)}, or ''")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                   help="dsjax config overrides applied to every dsjax row (the HF peers keep V2-Lite)")
    p.add_argument("--profile", default="", help="per dsjax row, one more process traces 3 steps (command "
                   "buffers off) into DIR/ROW and prints the device time per part of the step")
    p.add_argument("--profile-rows", default="", help="comma list: profile only these dsjax rows")
    p.add_argument("--hlo", default="", help="write each dsjax row's compiled HLO to DIR/ROW.hlo.txt")
    p.add_argument("--paired", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                   help="run every dsjax row without (A) and with (B) these overrides, back to back, "
                   "and print the change")
    p.add_argument("--baseline", default="", metavar="DIR", help="another source tree (a checkout of another "
                   "commit): each dsjax row runs from it (A) and from this tree (B) back to back")
    p.add_argument("--rounds", type=int, default=1, help="with --paired or --baseline: A, B rounds (alternating)")
    p.add_argument("--json", default="", help="also write the rows to this file")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        try:
            print(json.dumps(run_dsjax(args, args.child)), flush=True)
        except Exception:
            traceback.print_exc()
            sys.exit(1)
        return
    rows = [r for r in args.dsjax.split(",") if r]
    peers = [r for r in args.peers.split(",") if r]
    for name in rows:
        if name not in DSJAX_ROWS:
            p.error(f"--dsjax: unknown row {name!r} (have {sorted(DSJAX_ROWS)})")
    for name in peers:
        if name not in PEERS:
            p.error(f"--peers: unknown peer {name!r} (have {sorted(PEERS)})")
    extra = tuple(args.paired)
    if extra and args.baseline:
        p.error("--paired and --baseline: one comparison per run")
    if args.baseline and not os.path.isfile(os.path.join(args.baseline, "benchmarks", "train_step.py")):
        p.error(f"--baseline: {args.baseline} holds no benchmarks/train_step.py")
    results = []
    for _ in range(args.rounds if extra or args.baseline else 1):
        for r in rows:
            if args.baseline:
                results.append(run_child(args, r, tree=args.baseline))
            results.append(run_child(args, r))
            if extra:
                results.append(run_child(args, r, extra=extra))
    if args.profile:  # each row's first run (A with --paired)
        for r in rows:
            res = next(x for x in results if x["row"] == row_label(r))
            if args.profile_rows and r not in args.profile_rows.split(","):
                continue
            prof = run_child(args, r, profile=True)
            res["parts_ms"] = prof.get("parts_ms", {"error": prof.get("error", "?")})
            res["step_ms_no_command_buffers"] = prof.get("step_ms")
    results += [run_hf(args, r) for r in peers]
    def peer_row(name):  # the peer's result, None when it did not run or failed
        return next((r for r in results if r["row"] == PEERS[name].label and "error" not in r), None)

    ref = peer_row("hf_compile")
    print(f"\nV2-Lite geometry, {args.layers} layers, batch {args.batch} x {args.seq} per device"
          + (f", dsjax --set {' '.join(args.set)}" if args.set else ""))
    print(f"{'row':<46} {'step ms':>8} {'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'peak GB':>8} {'vs compile':>10}")
    ftok = next((r["flops_per_token"] for r in results if "flops_per_token" in r), None)
    for r in results:
        if "error" in r:
            print(f"{r['row']:<46} {'-':>8} {'-':>9} {'-':>8} {'-':>6} {'-':>8} {'-':>10}  {r['error']}")
            continue
        tf = r["tokens_per_s"] * ftok / 1e12 if ftok else float("nan")
        vs = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}" if ref else "-"
        peak = f"{r['peak_gb']:.1f}" if r.get("peak_gb") else "-"
        print(f"{r['row']:<46} {r['step_ms']:>8.1f} {r['tokens_per_s']:>9,.0f} {tf:>8.0f} "
              f"{tf / PEAK_TFLOPS:>6.1%} {peak:>8} {vs:>10}")
    for r in results:
        if "error" not in r:
            print(f"  {r['row']}: {describe(r.get('gpu'), args.steps)}")
    for name, what in (("hf_compile_clip", "the clipping torch.compile peer"), ("torchtitan", "torchtitan")):
        other = peer_row(name)
        for r in results:
            if other and r["row"].startswith("dsjax") and "error" not in r:
                print(f"  {r['row']}: {r['tokens_per_s'] / other['tokens_per_s']:.2f}x {what}")
    for r in results:
        if r.get("memory"):
            print(f"  {r['row']}: {describe_memory(r['memory'])}")
    if extra or args.baseline:
        print("\n".join(paired_lines(results, rows, extra, args.baseline)))
    for r in results:
        if "parts_ms" in r:
            print(format_parts(r["row"], r["parts_ms"], r.get("step_ms_no_command_buffers")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
