"""FLOP accounting (MFU) and metric sinks (JSONL + TensorBoard).

MFU follows PaLM appendix B (arXiv 2204.02311): training FLOP per token = 6 * N_active +
attention, where N_active counts every matmul weight a token touches (routed experts: only the
num_experts_per_tok it is sent to; the embedding lookup is not a matmul) and causal attention adds
3 * L * H * (Dqk + Dv) * T per token (forward 2*H*(Dqk+Dv)*T/2, backward 2x forward).
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import jax

from dsjax.config import ModelConfig

log = logging.getLogger("dsjax.train")

# Dense bf16 peak per device, FLOP/s (vendor datasheets); fp32 CPU has no meaningful MFU.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}


def active_params(cfg: ModelConfig) -> int:
    """Matmul parameters used per token (excludes the embedding table, includes lm_head)."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_head_dim
    if cfg.q_lora_rank:
        q = D * cfg.q_lora_rank + cfg.q_lora_rank * H * qk
    else:
        q = D * H * qk
    attn = (q + D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim) + H * cfg.v_head_dim * D)
    dense_mlp = 3 * D * cfg.intermediate_size
    F = cfg.moe_intermediate_size
    moe_mlp = 3 * D * F * (cfg.num_experts_per_tok + cfg.n_shared_experts) + D * cfg.n_routed_experts
    L, Ld = cfg.num_hidden_layers, cfg.first_k_dense_replace
    return L * attn + Ld * dense_mlp + (L - Ld) * moe_mlp + D * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOP per token at sequence length `seq_len`, causal."""
    attn = 3 * cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len
    return 6.0 * active_params(cfg) + attn


def device_peak_flops(dtype: str, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device for MFU, or None when unknown (e.g. CPU)."""
    if override_tflops:
        return override_tflops * 1e12
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return None
    kind = dev.device_kind
    for name, peak in PEAK_BF16.items():
        if name in kind:
            return peak if dtype != "float32" else peak / 2 ** 4  # tf32-free fp32 is ~1/16
    return None


class MetricsWriter:
    """Append one JSON object per record to RUN_DIR/metrics.jsonl; mirror scalars to TensorBoard.

    `start_step` is the step the run continues from (0 for a new run). Records an earlier
    process logged past it (after its last checkpoint, before it stopped) would be logged again
    by this run, so they move to RUN_DIR/metrics.superseded.jsonl (appended, with a warning
    naming the count) before the first write; at 0 every earlier record moves, since a run from
    step 0 logs step 0's validation again. A line cut short by a crash moves with them. The
    file is replaced atomically (written beside it, then renamed). TensorBoard hides the
    earlier events at steps >= start_step + 1 (`purge_step`; >= 0 at start 0).

    In a multi-process run every process computes the same (replicated) metrics; only process 0
    writes them (`primary`, default: jax.process_index() == 0). On the other processes the
    writer opens nothing and `write` does nothing."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, primary: bool | None = None,
                 start_step: int = 0):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.primary = jax.process_index() == 0 if primary is None else primary
        self.file = None
        self.tb = None
        if not self.primary:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._supersede_after(start_step)
        self.file = open(self.path, "a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter

            tb_dir = Path(run_dir) / "tb"
            purge = (start_step + 1 if start_step > 0 else 0) if tb_dir.is_dir() else None
            self.tb = SummaryWriter(str(tb_dir), purge_step=purge)

    def _supersede_after(self, start_step: int) -> None:
        """Move the records of steps > start_step (all of them at 0) to metrics.superseded.jsonl."""
        if not self.path.is_file():
            return
        keep, moved = [], []
        for line in self.path.read_text().splitlines(keepends=True):
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                step = None  # cut short by a crash, or not a record of ours
            ok = step is not None and line.endswith("\n") and start_step > 0 and step <= start_step
            (keep if ok else moved).append(line if line.endswith("\n") else line + "\n")
        if not moved:
            return
        aside = self.path.with_name("metrics.superseded.jsonl")
        with open(aside, "a") as f:
            f.writelines(moved)
            f.flush()
            os.fsync(f.fileno())
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        log.warning("%s: moved %d earlier record(s) of steps after %d (this run logs them again) to %s",
                    self.path, len(moved), start_step, aside)

    def write(self, step: int, record: dict) -> None:
        if self.file is None:
            return
        rec = {"step": int(step)}
        for k, v in record.items():
            if isinstance(v, (list, tuple)):
                rec[k] = [float(x) for x in v]
            elif isinstance(v, (int, float, str, bool)) or v is None:
                rec[k] = v
            else:
                rec[k] = float(v)
        self.file.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if k == "step":
                    continue
                if isinstance(v, list):
                    for i, x in enumerate(v):
                        self.tb.add_scalar(f"{k}/layer{i}", x, step)
                elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
