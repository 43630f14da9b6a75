"""LoRA fine-tuning at full DeepSeek-V2-Lite geometry on one GPU: dsjax against HF transformers + PEFT.

    python benchmarks/finetune.py [--rows dsjax_all,hf_peft,dsjax_attn] [--batch 4] [--seq 2048]
        [--steps 5] [--warmup 2] [--time-budget 500] [--set KEY=VALUE ...] [--json FILE] [--tiny]

Model: V2-Lite (`_step_common.V2_LITE`: vocab 102400, hidden 2048, 16 heads, no q LoRA, kv_lora_rank
512, 64 routed experts top-6 + 2 shared, first_k_dense_replace 1) with all 27 layers, 15.7 B
parameters, random weights (nothing is downloaded), batch 4 x 2048 random tokens, LoRA rank 16,
alpha 32, no dropout. Rows (each in its own process, so its peak memory is its own; the most
important first):

  dsjax_all        targets q_proj kv_a_proj_with_mqa kv_b_proj o_proj gate_proj up_proj down_proj
                   and `experts` (the routed experts' gate/up/down, one adapter per expert): the
                   issue's PEFT targets, routed experts included (in dsjax `gate_proj`/`up_proj`/
                   `down_proj` name the dense and shared-expert MLPs only)
  hf_peft          HF transformers DeepseekV2ForCausalLM + PEFT LoRA on the same names, bf16
                   weights on the GPU, no torch.compile, fused AdamW over the adapters. The child
                   prints which modules PEFT wrapped and whether the routed experts are among them.
                   PEFT 0.21.2 with transformers 5 (whose routed experts are fused 3-D parameters)
                   rewrites gate_proj/up_proj/down_proj to target_parameters gate_up_proj and
                   down_proj of the routed experts (per-expert adapters, rank 2r on the fused
                   gate_up) and then wraps neither the dense MLP (layer 0) nor the shared experts:
                   it reaches the 4 attention projections and the routed experts.
  dsjax_attn       attention projections only (q_proj kv_a_proj_with_mqa kv_b_proj o_proj): the
                   cost of expert LoRA is dsjax_all against this row
  dsjax_peft_reach exactly what PEFT reaches: attention projections + routed experts (optional;
                   dsjax_all adapts the dense and shared MLPs besides, ~7 M parameters more)
  dsjax_all_dots   dsjax_all with model.remat=dots_saveable (GEMM outputs kept, the rest
                   recomputed in the backward): the row within half of HF + PEFT's memory
  dsjax_all_remat  dsjax_all with model.remat=full (optional)
  hf_peft_attn     hf_peft on the attention projections only (optional)

dsjax builds the state as `python -m dsjax.train` builds a LoRA run from random init
(`finetune.init_model`, `finetune.partition`, `step.init_state`, `loop.state_shardings`,
`loop.jit_train_step`): frozen base weights in bf16 (model.dtype) with no optimizer state, the
router stays fp32, adapters trainable with fp32 master weights and fp32 Adam moments. The one
difference: init, partition and optimizer state run inside one jit, so the random fp32 base
weights (63 GB) are never materialised beside their bf16 copies and the allocator's peak is the
step's. Every dsjax row runs with the model's default unrolled layers (2-3 minutes of compile on an
H200; --set model.scan_layers=true scans them: under a minute, ~15 % slower) and
model.moe_recompute=true (the MoE blocks recompute their permutations and SwiGLUs in the
backward); `--set` adds config overrides to every dsjax row (e.g. --set model.remat=dots_saveable).

Memory, measured on one H200 (benchmarks/RESULTS.md, "LoRA fine-tuning"; no remat): dsjax_attn
73.6 GB, dsjax_all 94.2 GB (54.8 GB as dsjax_all_dots), both before the residual cuts of f4d032a;
dsjax_all with model.moe_recompute=true 59.5 GB with model.scan_layers=true (d6372b4), 57.4 GB
unrolled and 14 % faster (47a6109: the expert kernels read the frozen weights in place from their
stacks). Frozen bf16 weights are 15.7 B x
2 B = 31.4 GB and the adapters ~0.29 B x 16 B (fp32 master, gradient, two moments) = 4.6 GB; the
rest is the activations of 27 scanned layers, which `model.moe_recompute` and `model.remat` trade
for recompute. `python -m dsjax.plan` (CPU compile of this step, 1 device; it gave 74.5 GB for
dsjax_attn, and 61.2 GB for the 59.7 GB row of f4d032a; it does not predict unrolled layers, which
XLA:CPU and XLA:GPU buffer differently: 28-30 GB planned for a 4-layer step that measured 21 GB) plans
any of these rows, e.g. dsjax_all_dots:

    python -m dsjax.plan --config configs/deepseek_v2_lite.yaml --devices 1 --no-check \
        --set mesh.preset=fsdp --set mesh.expert=1 --set model.scan_layers=true \
        --set data.batch_size=4 --set data.seq_len=2048 --set lora.rank=16 --set lora.alpha=32 \
        --set "lora.target_modules=[q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, gate_proj, up_proj, down_proj, experts]" \
        --set model.remat=dots_saveable

Columns: step ms (mean of --steps after --warmup untimed steps; dsjax's first step is also its
compile), tokens/s (B x T / step), peak GB (dsjax: the allocator's `peak_bytes_in_use` over the
whole process; HF: `torch.cuda.max_memory_allocated`, also whole process), trainable params, and
tokens/s and peak memory as ratios to hf_peft; each row's line under the table ends with its
median SM clock and power over the timed steps and its energy per step (`gpu_power.py`, NVML):
whether it ran at the GPU's power cap. A row that fails (out of memory, an error) is a
table row with its error; rows not started within --time-budget seconds are reported skipped,
and a row still running at --time-budget + 60 s is killed.

`--profile DIR` traces two more steps of every dsjax row into DIR/ROW and prints its device time
per part of the step (attention, MoE kernels, LoRA adapters, GEMMs, optimizer, ...; as
`train_step.py --profile`). The dsjax rows then run with XLA's command buffers off, so that each
kernel maps to its HLO op: their timed steps are those of that setting (a GPU is needed for the
per-part times).

PEFT on the GPU machine: if `import peft` fails, or `.whl/peft-*.whl` is in the repository (the
version the issue measured, 0.21.2; carry `.whl` with the run), the wheel is put on sys.path (a
py3-none-any wheel is importable as a zip), and so is `.whl/accelerate-*.whl` when `accelerate`
(a PEFT dependency) is missing. `--tiny` (2 layers, hidden 128, 4 experts, B1 x T128) runs
every row end to end on CPU, HF + PEFT included.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import re
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _step_common import V2_LITE  # noqa: E402
from gpu_power import PowerSampler, describe  # noqa: E402
from train_step import format_parts, random_batch, time_steps, traced_parts  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTN = ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
ALL = ATTN + ["gate_proj", "up_proj", "down_proj"]  # the PEFT target_modules
ROWS = {  # name: (kind, HF / PEFT target names, dsjax-only extra targets, dsjax row overrides)
    "dsjax_all": ("dsjax", ALL, ["experts"], []),
    "hf_peft": ("hf", ALL, [], []),
    "dsjax_attn": ("dsjax", ATTN, [], []),
    "dsjax_peft_reach": ("dsjax", ATTN, ["experts"], []),
    "dsjax_all_dots": ("dsjax", ALL, ["experts"], ["model.remat=dots_saveable"]),
    "dsjax_all_remat": ("dsjax", ALL, ["experts"], ["model.remat=full"]),
    "hf_peft_attn": ("hf", ATTN, [], []),
}
DEFAULT_ROWS = "dsjax_all_dots,hf_peft,dsjax_all,dsjax_attn"
RANK, ALPHA = 16, 32
# the optimizer as the HF row's torch AdamW(lr=1e-4) with its default weight decay 0.01: constant
# rate, no warmup, so both rows' losses move alike over the few timed steps
DSJAX_BASE = ["model.moe_recompute=true", f"lora.rank={RANK}", f"lora.alpha={ALPHA}", "lora.dropout=0.0",
              "optim.learning_rate=1e-4", "optim.warmup_steps=0", "optim.schedule=constant",
              "optim.weight_decay=0.01"]
TINY = ["model.vocab_size=1024", "model.hidden_size=128", "model.num_attention_heads=2",
        "model.kv_lora_rank=64", "model.qk_nope_head_dim=32", "model.qk_rope_head_dim=16",
        "model.v_head_dim=32", "model.n_routed_experts=4", "model.num_experts_per_tok=2",
        "model.moe_intermediate_size=64", "model.intermediate_size=256"]


def geometry(args) -> list[str]:
    """Model overrides shared by both stacks (the HF config is derived from them)."""
    return V2_LITE + (TINY if args.tiny else []) + [f"model.num_hidden_layers={args.layers}",
                                                     f"data.seq_len={args.seq}"]


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- dsjax -----------------------------------------------------------------------------------
def run_dsjax(args, row: str) -> dict:
    """One dsjax LoRA row: the state as `dsjax.train` builds it (one jit), the step jitted as
    `dsjax.train.loop` jits it, timed over args.steps after args.warmup steps."""
    import jax
    import numpy as np
    from flax import nnx

    from dsjax import config as C
    from dsjax.model import DeepSeekModel
    from dsjax.model.lora import attach_adapters
    from dsjax.train import finetune
    from dsjax.train.loop import global_batch, jit_train_step, setup_parallel, state_shardings
    from dsjax.train.optim import build_optimizer
    from dsjax.train.step import init_state

    _, targets, extra, row_sets = ROWS[row]
    sets = geometry(args) + DSJAX_BASE + [f"lora.target_modules=[{', '.join(targets + extra)}]"]
    sets += row_sets + args.set + [f"data.batch_size={args.batch}"]
    cfg = C.load(None, sets)
    par = setup_parallel(cfg)
    tx, sched = build_optimizer(cfg.optim, 1000)
    fns, _, _ = finetune.abstract_model(cfg, cfg.train.seed)

    def build():  # finetune.init_model + partition + init_state, traced: no fp32 base copy lives
        model = DeepSeekModel(cfg.model, rngs=nnx.Rngs(cfg.train.seed))
        attach_adapters(model, cfg.lora, nnx.Rngs(cfg.train.seed + 1))
        _, ps, rs = nnx.split(model, nnx.Param, ...)
        train, frozen = finetune.partition(cfg, ps.to_pure_dict())
        return init_state(train, rs.to_pure_dict(), tx, 1.0, frozen=frozen or None, compute_dtype=cfg.model.dtype)

    t0 = time.perf_counter()
    sh = state_shardings(fns, tx, par, jax.eval_shape(build))
    init = jax.jit(build, out_shardings=sh).lower().compile()
    init_mem = init.memory_analysis()
    state = init()
    jax.block_until_ready(state)
    size = lambda t: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(t))
    n_train, n_frozen = size(state["params"]), size(state.get("frozen", {}))
    say(f"[{row}] state built in {time.perf_counter() - t0:.1f} s: {n_train:,} trainable, "
        f"{n_frozen:,} frozen params" + (f", init temporaries {init_mem.temp_size_in_bytes / 1e9:.2f} GB"
                                         if init_mem is not None else ""))
    step = jit_train_step(cfg, fns, tx, sched, par, sh)
    B, T = args.batch, args.seq
    batch = global_batch(par, random_batch(cfg.model.vocab_size, B, T), 1)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    step_gb = None
    if mem is not None:
        step_gb = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                   + mem.temp_size_in_bytes) / 1e9
    say(f"[{row}] compiled in {compile_s:.1f} s" + (f", XLA's step footprint {step_gb:.2f} GB" if step_gb else ""))
    state, m = compiled(state, batch)
    first_loss = float(m["loss"])
    say(f"[{row}] first step loss {first_loss:.4f}")
    state, m, dt, gpu = time_steps(compiled, state, batch, args.warmup - 1, args.steps)
    stats = jax.devices()[0].memory_stats() or {}
    loss = float(m["loss"])
    parts = {}
    if args.profile:
        parts = {"parts_ms": traced_parts(compiled, state, batch, os.path.join(args.profile, row), 2)}
    return {**parts, "row": row, "step_ms": dt * 1e3, "tokens_per_s": B * T / dt,
            "peak_gb": stats.get("peak_bytes_in_use", 0) / 1e9 or None, "step_gb": step_gb,
            "trainable": n_train, "frozen": n_frozen, "compile_s": compile_s, "first_loss": first_loss,
            "loss": loss, "targets": targets + extra, "gpu": gpu,
            "dtypes": "frozen bf16, adapters fp32 master + fp32 Adam, bf16 compute"}


# -- HF transformers + PEFT ------------------------------------------------------------------
def import_peft():
    """peft, from the carried wheel in .whl/ when there is one (module docstring)."""
    wheels = {os.path.basename(w).split("-")[0]: w for w in sorted(glob.glob(os.path.join(REPO, ".whl", "*.whl")))}
    if "peft" in wheels:
        sys.path.insert(0, wheels["peft"])
    if importlib.util.find_spec("accelerate") is None and "accelerate" in wheels:  # a PEFT dependency
        sys.path.insert(0, wheels["accelerate"])
    import peft
    return peft


def run_hf(args, row: str) -> dict:
    """One HF + PEFT row: DeepseekV2ForCausalLM of the same geometry, random bf16 weights made on
    the device, PEFT LoRA, fused AdamW over the adapters, causal LM loss."""
    import torch

    peft = import_peft()
    import transformers
    from peft.tuners.lora import LoraLayer

    from dsjax import config as C
    from dsjax.hf.config import model_config_to_hf

    _, targets, _, _ = ROWS[row]
    mcfg = C.load(None, geometry(args)).model
    d = model_config_to_hf(mcfg)
    for k in ("architectures", "model_type"):
        d.pop(k)
    hf_cfg = transformers.DeepseekV2Config(**d)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = transformers.DeepseekV2ForCausalLM(hf_cfg)
    torch.set_default_dtype(torch.float32)
    n_base = sum(p.numel() for p in model.parameters())
    say(f"[{row}] HF model built in {time.perf_counter() - t0:.1f} s: {n_base:,} params, "
        f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}, "
        f"attention {model.config._attn_implementation}")
    lcfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0)
    model = peft.get_peft_model(model, lcfg)
    wrapped = {}  # layer-free module name (+ ":param" for a wrapped parameter) -> count
    for n, m in model.named_modules():
        if isinstance(m, LoraLayer):  # a wrapped parameter (ParamWrapper) names it after ':'
            key = re.sub(r"^.*layers\.\d+\.", "", n).replace(".base_layer", "")
            key += f":{m.parameter_name}" if hasattr(m, "parameter_name") else ""
            wrapped[key] = wrapped.get(key, 0) + 1
    routed = sorted(k for k in wrapped if ".experts" in k and "shared_experts" not in k)
    pc = model.peft_config["default"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in trainable)
    say(f"[{row}] PEFT rewrote target_modules to {sorted(pc.target_modules)}, target_parameters "
        f"{sorted(pc.target_parameters or [])}; wrapped (per layer name: count) {wrapped}; routed experts "
        f"{'wrapped' if routed else 'NOT wrapped'}; {n_train:,} trainable params")
    model.train()
    opt = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    B, T = args.batch, args.seq
    x = torch.randint(0, hf_cfg.vocab_size, (B, T), device=dev, generator=None)

    def step():
        loss = model(input_ids=x, labels=x).loss  # HF shifts the labels
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    first_loss = step().item()
    say(f"[{row}] first step {time.perf_counter() - t0:.1f} s, loss {first_loss:.4f}")
    for _ in range(args.warmup - 1):
        step()
    sync()
    with PowerSampler() as ps:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        sync()
        dt = (time.perf_counter() - t0) / args.steps
    peak = torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None
    return {"row": row, "step_ms": dt * 1e3, "tokens_per_s": B * T / dt, "peak_gb": peak,
            "trainable": n_train, "first_loss": first_loss, "loss": loss.item(), "targets": targets,
            "peft_wrapped": wrapped, "peft_routed_experts": routed, "gpu": ps.summary(),
            "versions": {"transformers": transformers.__version__, "peft": peft.__version__,
                         "torch": torch.__version__},
            "attention": model.config._attn_implementation,
            "dtypes": "bf16 weights and adapters, bf16 AdamW state (fused), no torch.compile"}


# -- parent ----------------------------------------------------------------------------------
def run_child(args, row: str, deadline: float) -> dict:
    """Run `row` in its own process, echoing its progress lines; its result is the line that
    starts with RESULT. Killed at `deadline` (time.monotonic)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", row, "--layers", str(args.layers),
           "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--warmup", str(args.warmup)] + (["--tiny"] if args.tiny else [])
    cmd += ["--set", *args.set] if args.set else []
    cmd += ["--profile", args.profile] if args.profile else []
    env = dict(os.environ)
    if args.profile:  # every kernel its own event, attributable to its HLO op
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    env["PYTHONPATH"] = os.pathsep.join(x for x in (REPO, env.get("PYTHONPATH", "")) if x)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []

    def pump():
        for ln in proc.stdout:
            lines.append(ln.rstrip("\n"))
            if not ln.startswith("RESULT "):
                print(f"  {ln.rstrip()}", file=sys.stderr, flush=True)
    th = threading.Thread(target=pump, daemon=True)
    th.start()
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        th.join(5)
        return {"row": row, "error": "killed: past --time-budget + 60 s"}
    th.join(5)
    res = [ln for ln in lines if ln.startswith("RESULT ")]
    if proc.returncode == 0 and res:
        return json.loads(res[-1][len("RESULT "):])
    text = "\n".join(lines)
    if "RESOURCE_EXHAUSTED" in text or "OutOfMemory" in text or "out of memory" in text.lower():
        return {"row": row, "error": "out of memory"}
    tail = [ln for ln in lines if ln.strip()] or ["exit code %d" % proc.returncode]
    return {"row": row, "error": tail[-1][-200:]}


def table(args, results: list[dict]) -> str:
    ref = next((r for r in results if r["row"] == "hf_peft" and "error" not in r and "skipped" not in r), None)
    geo = "tiny test geometry (2 layers, hidden 128, 4 experts)" if args.tiny else "V2-Lite geometry"
    out = [f"\n{geo}, {args.layers} layers, batch {args.batch} x {args.seq}, LoRA rank {RANK} alpha {ALPHA}, "
           f"{args.steps} timed steps after {args.warmup}"
           + (f"; dsjax --set {' '.join(args.set)}" if args.set else ""),
           f"{'row':<16} {'step ms':>9} {'tokens/s':>10} {'peak GB':>8} {'trainable':>12} "
           f"{'tok/s vs hf_peft':>16} {'mem vs hf_peft':>14}"]
    for r in results:
        if "error" in r or "skipped" in r:
            out.append(f"{r['row']:<16} {'-':>9} {'-':>10} {'-':>8} {'-':>12} {'-':>16} {'-':>14}  "
                       + (r.get("error") or r["skipped"]))
            continue
        peak = f"{r['peak_gb']:.1f}" if r.get("peak_gb") else "-"
        vs = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
        mem = f"{r['peak_gb'] / ref['peak_gb']:.2f}" if ref and ref.get("peak_gb") and r.get("peak_gb") else "-"
        out.append(f"{r['row']:<16} {r['step_ms']:>9.1f} {r['tokens_per_s']:>10,.0f} {peak:>8} "
                   f"{r['trainable']:>12,} {vs:>16} {mem:>14}")
    for r in results:
        if "error" in r or "skipped" in r:
            continue
        extra = (f"compile {r['compile_s']:.0f} s, XLA step footprint {r['step_gb']:.2f} GB, "
                 if r.get("step_gb") else "")
        line = (f"  {r['row']}: targets {' '.join(r['targets'])}; {r['dtypes']}; {extra}"
                f"loss {r['first_loss']:.3f} -> {r['loss']:.3f}")
        if "peft_wrapped" in r:
            line += (f"; PEFT wrapped {', '.join(f'{k} x{v}' for k, v in r['peft_wrapped'].items())}; routed experts "
                     f"{'wrapped' if r['peft_routed_experts'] else 'NOT reached'}; attention "
                     f"{r['attention']}; " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()))
        out.append(line + f"; {describe(r.get('gpu'), args.steps)}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma list, run in this order, of {list(ROWS)}")
    p.add_argument("--layers", type=int, default=None, help="default 27 (2 with --tiny)")
    p.add_argument("--batch", type=int, default=None, help="default 4 (1 with --tiny)")
    p.add_argument("--seq", type=int, default=None, help="default 2048 (128 with --tiny)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    p.add_argument("--time-budget", type=float, default=900.0,
                   help="seconds: rows not started by then are skipped; a row running at budget + 60 s is killed")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                   help="dsjax config overrides for every dsjax row (the HF rows keep the geometry)")
    p.add_argument("--tiny", action="store_true", help="2-layer toy geometry, B1 x T128: every row on CPU")
    p.add_argument("--json", default="", help="also write the rows to this file")
    p.add_argument("--profile", default="", help="trace 2 more steps of each dsjax row into DIR/ROW and "
                   "print its device time per part (command buffers off for the dsjax rows)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    tiny = args.tiny
    args.layers = args.layers or (2 if tiny else 27)
    args.batch = args.batch or (1 if tiny else 4)
    args.seq = args.seq or (128 if tiny else 2048)
    args.warmup = max(args.warmup, 1)
    if args.child:
        try:
            fn = run_dsjax if ROWS[args.child][0] == "dsjax" else run_hf
            print("RESULT " + json.dumps(fn(args, args.child)), flush=True)
        except Exception:
            traceback.print_exc()
            sys.exit(1)
        return
    rows = [r for r in args.rows.split(",") if r]
    for name in rows:
        if name not in ROWS:
            p.error(f"--rows: unknown row {name!r} (have {list(ROWS)})")
    start = time.monotonic()
    results = []
    for name in rows:
        used = time.monotonic() - start
        if used > args.time_budget:
            results.append({"row": name,
                            "skipped": f"skipped: {used:.0f} s used of --time-budget {args.time_budget:.0f}"})
            continue
        say(f"== {name} (at {used:.0f} s)")
        t0 = time.monotonic()
        results.append(run_child(args, name, start + args.time_budget + 60))
        results[-1]["wall_s"] = time.monotonic() - t0
    print(table(args, results), flush=True)
    for r in results:
        if "parts_ms" in r:
            print(format_parts(r["row"], r["parts_ms"], r["step_ms"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
