"""HF DeepSeek-V2/V3 safetensors -> dsjax pure state, streaming tensor by tensor.

Each of our leaves is one host buffer in its target dtype (64-byte aligned, so on CPU
`jax.device_put(..., may_alias=True)` adopts it without a copy); every HF tensor is read, FP8
blocks dequantised, transposed per the table (`dsjax.hf.mapping`) and written into its slice of
that buffer, then dropped. Peak host memory: one copy of the model in the target dtype plus the
largest single HF tensor (in float32 when dequantising FP8).

FP8 kept as it ships: the leaves named in `fp8_keep` (frozen weights of a run under
`model.fp8=blockwise`) whose every HF tensor is float8_e4m3fn with a `weight_scale_inv` on
128 x 128 blocks are not dequantised: they load as `pallas_kernels.fp8.frozen.Fp8Weight`
(q [..., in, out] = W.T, s [..., ceil(in/128), ceil(out/128)] = weight_scale_inv.T), the
weight operand of the FP8 GEMMs as stored.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from dsjax.config import ModelConfig
from dsjax.hf import mapping as M
from dsjax.hf.config import model_config_from_hf
from dsjax.hf.safetensors_io import SCALE_SUFFIX, CheckpointError, SafetensorsCheckpoint
from dsjax.model import abstract_model
from pallas_kernels.fp8.frozen import Fp8Weight, scale_grid
from sharding.rules import fp8_scale_spec

log = logging.getLogger("dsjax.hf")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FIRST = 5  # names listed per problem kind in error messages


def read_hf_config(path: str | Path) -> dict:
    """The HF config of a checkpoint: `path` is its directory, one of its files (the
    config.json beside it is read, also for its `*.safetensors.index.json`), or a JSON config
    file itself.

    Raises FileNotFoundError naming the directory when there is no config.json."""
    p = Path(path)
    if p.is_file() and p.suffix == ".json" and not p.name.endswith(".index.json"):
        return json.loads(p.read_text())
    f = p / "config.json" if p.is_dir() else p.parent / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"hf: no config.json in {f.parent}")
    return json.loads(f.read_text())


def _aligned_empty(shape, dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(n + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off:off + n].view(dt).reshape(shape)


def _leaf_info(leaf) -> tuple[tuple[int, ...], np.dtype, Any]:
    sharding = getattr(leaf, "sharding", None)
    return tuple(leaf.shape), np.dtype(leaf.dtype), sharding


def _block_size(hf_cfg: dict | None) -> tuple[int, int]:
    q = (hf_cfg or {}).get("quantization_config") or {}
    b = q.get("weight_block_size") or [128, 128]
    return int(b[0]), int(b[1])


def _problems(kind: str, names: list[str]) -> str:
    shown = ", ".join(names[:_FIRST])
    more = f" (+{len(names) - _FIRST} more)" if len(names) > _FIRST else ""
    return f"{len(names)} {kind}: {shown}{more}"


def _fp8_leaves(ck: SafetensorsCheckpoint, table: list, keep, block: tuple[int, int], path) -> set:
    """The (tree, path) of the leaves in `keep` that load as `Fp8Weight`: every HF tensor filling
    the leaf is in the checkpoint, FP8 with its scale, on 128 x 128 blocks."""
    if not keep:
        return set()
    by_leaf: dict = {}
    for e in table:
        if e.tree == "params" and e.path in keep:
            by_leaf.setdefault(e.path, []).append(e.hf)
    out = {("params", p) for p, names in by_leaf.items()
           if all(k in ck and ck.is_quantized(k) and ck.dtype(k) == "F8_E4M3" for k in names)}
    if out and block != (128, 128):
        log.warning("hf: %s has FP8 weights on %dx%d blocks; the FP8 GEMMs use 128x128, so they are "
                    "dequantised", path, *block)
        return set()
    return out


def load_hf_params(path: str | Path, model_cfg: ModelConfig, params: dict, rest: dict,
                   *, hf_config: dict | None = None, fp8_keep=None) -> tuple[dict, dict]:
    """Fill our (params, rest) pure dicts from the HF checkpoint at `path`.

    Args:
      path: HF directory (config.json + model.safetensors or sharded + index) or one file.
      model_cfg: the architecture the trees were built for (shapes must match the checkpoint).
      params, rest: pure dicts of jax arrays or ShapeDtypeStructs; only their shapes, dtypes and
        shardings are used (values are replaced), so abstract trees avoid a random init.
      hf_config: parsed config.json (read from `path` when None and present), for FP8 block size.
      fp8_keep: paths (tuples of names) of `params` leaves to keep in FP8 where the checkpoint
        stores them so (module docstring); None: dequantise every FP8 tensor.
    Returns:
      (params, rest) with every leaf a jax.Array of the template's dtype and sharding, or, for
      the leaves kept in FP8, an `Fp8Weight` of the template's shape (the values in the
      template's sharding, the scales following it, `sharding.rules.fp8_scale_spec`).
    Raises:
      CheckpointError: missing, unexpected or mis-shaped tensors (counts and first names), a
        weight_scale_inv off its weight's block grid, or an unreadable file. MTP layers
        (`model.layers.{num_hidden_layers + k}.*`) are ignored with a log note when MTP is not
        configured; when MTP is configured but the checkpoint has no MTP tensors at all, the MTP
        parameters keep their values from the templates (a warning).
    """
    ck = SafetensorsCheckpoint(path)
    if hf_config is None:
        try:
            hf_config = read_hf_config(path)
        except FileNotFoundError:
            hf_config = None
    block = _block_size(hf_config)
    if hf_config is not None:  # shapes are checked per tensor; routing/RoPE semantics only here
        try:
            theirs = model_config_from_hf(hf_config)
        except ValueError as e:
            log.warning("hf: cannot interpret %s/config.json (%s); loading by shapes only", path, e)
        else:
            keys = ("topk_method", "scoring_func", "norm_topk_prob", "routed_scaling_factor", "n_group",
                    "topk_group", "num_experts_per_tok", "rope_theta", "rope_scaling", "rope_interleave",
                    "rms_norm_eps", "first_k_dense_replace")
            diff = [f"{k}={getattr(model_cfg, k)!r} (checkpoint {getattr(theirs, k)!r})"
                    for k in keys if getattr(model_cfg, k) != getattr(theirs, k)]
            if diff:
                log.warning("hf: model config differs from %s/config.json: %s", path, "; ".join(diff))
    trees = {"params": params, "rest": rest}
    table = M.entries(model_cfg, params, rest)
    by_key = {e.hf: e for e in table}
    L, K = model_cfg.num_hidden_layers, model_cfg.num_nextn_predict_layers
    fused = {}  # (layer prefix, fused suffix) -> our paths
    for n in range(L + K):
        loc = M.layer_location(model_cfg, n)
        if loc is None or n < model_cfg.first_k_dense_replace or model_cfg.n_routed_experts == 0:
            continue
        for suffix, ours in M.FUSED:
            fused[f"model.layers.{n}.{suffix}"] = [(loc[0] + tuple(o.split(".")), loc[1]) for o in ours]

    fp8 = _fp8_leaves(ck, table, set(fp8_keep or ()), block, path)
    bufs: dict[tuple[str, tuple[str, ...]], np.ndarray | tuple[np.ndarray, np.ndarray]] = {}

    def buf(tree: str, path: tuple[str, ...]):
        key = (tree, path)
        if key not in bufs:
            shape, dt, _ = _leaf_info(M.get_path(trees[tree], path))
            if key in fp8:  # (values, scales)
                bufs[key] = (_aligned_empty(shape, np.dtype(ml_dtypes.float8_e4m3fn)),
                             _aligned_empty(scale_grid(shape), np.float32))
            else:
                bufs[key] = _aligned_empty(shape, dt)
        return bufs[key]

    done: set[str] = set()
    unexpected, misshaped, ignored_mtp = [], [], []
    keys = sorted(ck.keys(), key=lambda k: (str(ck.file(k)), k))
    for k in keys:
        if k.endswith(SCALE_SUFFIX) and k[:-len(SCALE_SUFFIX)] in ck:
            continue  # consumed with its weight
        if k.endswith("rotary_emb.inv_freq"):
            continue  # non-persistent buffer written by old checkpoints
        m = _LAYER.match(k)
        n = int(m.group(1)) if m else -1
        if m and n >= L and (n >= L + K or m.group(2) in M.MTP_SHARED):
            if n >= L + K:
                ignored_mtp.append(k)
            continue
        e = by_key.get(k)
        if e is not None:
            leaf = M.get_path(trees[e.tree], e.path)
            want = M.hf_shape(e, tuple(leaf.shape))
            if ck.shape(k) != want:
                misshaped.append(f"{k} {list(ck.shape(k))} (expected {list(want)})")
                continue
            if (e.tree, e.path) in fp8:
                q, sc = ck.read(k), ck.read(k + SCALE_SUFFIX)
                if sc.shape != scale_grid(q.shape):
                    raise CheckpointError(f"{k}{SCALE_SUFFIX}: shape {list(sc.shape)} does not match weight "
                                          f"{list(q.shape)} with 128x128 blocks (expected "
                                          f"{list(scale_grid(q.shape))})")
                qb, sb = buf(e.tree, e.path)
                qb[e.index], sb[e.index] = q.T, sc.T
                done.add(k)
                continue
            x = ck.read_dequant(k, block)
            b = buf(e.tree, e.path)
            b[e.index] = x.T if e.op == M.T else x
            done.add(k)
            continue
        if k in fused:
            targets = fused[k]
            (p0, idx) = targets[0]
            leaf_shape = tuple(M.get_path(params, p0).shape[len(idx):])  # [E, D, F] or [E, F, D]
            E = leaf_shape[0]
            want = ((E, 2 * leaf_shape[2], leaf_shape[1]) if len(targets) == 2
                    else (E, leaf_shape[2], leaf_shape[1]))
            if ck.shape(k) != want:
                misshaped.append(f"{k} {list(ck.shape(k))} (expected {list(want)})")
                continue
            x = ck.read(k)
            F = leaf_shape[2]
            parts = [x[:, :F], x[:, F:]] if len(targets) == 2 else [x]
            for (p, idx), part in zip(targets, parts):
                buf("params", p)[idx] = np.swapaxes(part, 1, 2)
            pre = k[:k.index("mlp.experts.")]
            names = ("gate_proj", "up_proj") if len(targets) == 2 else ("down_proj",)
            done.update(f"{pre}mlp.experts.{j}.{nm}.weight" for j in range(E) for nm in names)
            continue
        unexpected.append(k)
    if ignored_mtp:
        log.info("hf: ignored %d MTP tensors (model.layers.%d+) since model.num_nextn_predict_layers=%d",
                 len(ignored_mtp), L + K, K)
    bad = {m.split(" ")[0] for m in misshaped}
    missing = [e.hf for e in table if e.hf not in done and e.hf not in bad]
    mtp_missing = [h for h in missing if (m := _LAYER.match(h)) and int(m.group(1)) >= L]
    if K and len(mtp_missing) == sum(1 for e in table if (m := _LAYER.match(e.hf)) and int(m.group(1)) >= L):
        log.warning("hf: %s has no MTP tensors (model.layers.%d.*); the %d MTP layer(s) keep their "
                    "initial values", path, L, K)
        missing = [h for h in missing if h not in set(mtp_missing)]
        skip_mtp = True
    else:
        skip_mtp = False
    if missing or unexpected or misshaped:
        parts = [_problems(kind, names) for kind, names in
                 (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if names]
        raise CheckpointError(f"hf: {path}: " + "; ".join(parts))

    def finish(tree_name: str, tree: dict, prefix: tuple[str, ...] = ()):
        out = {}
        for name, v in tree.items():
            path = prefix + (name,)
            if isinstance(v, dict):
                out[name] = finish(tree_name, v, path)
                continue
            b = bufs.pop((tree_name, path), None)
            if b is None:
                if not (skip_mtp and path[0] == "mtp") or not isinstance(v, jax.Array):
                    raise CheckpointError(f"hf: {path}: no tensor fills {tree_name}.{'.'.join(path)}")
                out[name] = v
                continue
            _, _, sharding = _leaf_info(v)
            if isinstance(b, tuple):
                out[name] = _place_fp8(*b, sharding)
                continue
            if sharding is not None:
                out[name] = jax.device_put(b, sharding, may_alias=True)
            else:
                out[name] = jax.device_put(b, may_alias=True)
            del b
        return out

    return finish("params", params), finish("rest", rest)


def _place_fp8(q: np.ndarray, s: np.ndarray, sharding) -> Fp8Weight:
    """Host (values, scales) -> device `Fp8Weight`, the values in the weight's `sharding`."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        s_sh = jax.sharding.NamedSharding(sharding.mesh, fp8_scale_spec(sharding.spec, s.shape, sharding.mesh))
        return Fp8Weight(jax.device_put(q, sharding, may_alias=True), jax.device_put(s, s_sh, may_alias=True))
    if sharding is not None and len(sharding.device_set) == 1:
        return Fp8Weight(jax.device_put(q, sharding, may_alias=True), jax.device_put(s, sharding, may_alias=True))
    return Fp8Weight(jax.device_put(q, may_alias=True), jax.device_put(s, may_alias=True))


def checkpoint_mtp_layers(path: str | Path, num_hidden_layers: int) -> int:
    """How many MTP layers (`model.layers.{num_hidden_layers + k}.*`) the checkpoint holds."""
    ck = SafetensorsCheckpoint(path)
    ns = {int(m.group(1)) for k in ck.keys() if (m := _LAYER.match(k))}
    k = 0
    while num_hidden_layers + k in ns:
        k += 1
    return k


def load_hf(path: str | Path, base: ModelConfig | None = None, *, dtype: str | None = None,
            weight_dtype: str | None = None):
    """Load an HF DeepSeek-V2/V3 directory: returns (ModelConfig, ModelFns, params, rest).

    The config comes from config.json (`dsjax.hf.config.model_config_from_hf`) over `base` for
    dsjax-only fields; `dtype`/`weight_dtype` override compute / storage dtypes. When config.json
    asks for MTP layers that the checkpoint lacks (transformers writes num_nextn_predict_layers
    but never saves MTP weights), MTP is turned off with a log note. `fns.merge(params, rest)`
    builds the module.
    """
    hf = read_hf_config(path)
    cfg = model_config_from_hf(hf, base, where=f"{path}/config.json")
    over = {k: v for k, v in (("dtype", dtype), ("weight_dtype", weight_dtype)) if v is not None}
    if cfg.num_nextn_predict_layers:
        have = checkpoint_mtp_layers(path, cfg.num_hidden_layers)
        if have < cfg.num_nextn_predict_layers:
            log.info("hf: config.json has num_nextn_predict_layers=%d but the checkpoint holds %d MTP "
                     "layer(s); using %d", cfg.num_nextn_predict_layers, have, have)
            over["num_nextn_predict_layers"] = have
    cfg = dataclasses.replace(cfg, **over)
    fns, params, rest = abstract_model(cfg)
    params, rest = load_hf_params(path, cfg, params, rest, hf_config=hf)
    return cfg, fns, params, rest
