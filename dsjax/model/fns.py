"""The model as pure state: `ModelFns` rebuilds a `DeepSeekModel` from the pure dicts that the
train step, checkpoints and the HF converter pass around.

A model splits into `params` (nnx.Param leaves: the trained weights) and `rest` (everything
else: the noaux_tc router biases), each a pure nested dict of arrays.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.model.layers import Linear
from dsjax.model.moe import EXPERT_PROJS, MoE
from dsjax.model.transformer import DeepSeekModel


@dataclasses.dataclass(frozen=True)
class ModelFns:
    """Closures over one model's graph: rebuild the module from pure dicts inside `jit`."""

    graphdef: Any
    abstract_params: Any
    abstract_rest: Any

    def merge(self, params, rest) -> DeepSeekModel:
        ps = jax.tree.map(lambda x: x, self.abstract_params)
        nnx.replace_by_pure_dict(ps, params)
        rs = jax.tree.map(lambda x: x, self.abstract_rest)
        nnx.replace_by_pure_dict(rs, rest)
        return nnx.merge(self.graphdef, ps, rs)

    def fp8_weight_paths(self) -> frozenset[tuple[str, ...]]:
        """Paths in the params dict of the weights that an FP8 GEMM consumes (model.fp8 =
        blockwise): the kernel of every `Linear` built with fp8 (all but the lm_head) and the
        routed experts' EXPERT_PROJS stacks of every `MoE` (decoder and MTP layers); not the
        embeddings, router gates, norms, biases or LoRA adapters. Empty under model.fp8=none.
        Read from the modules themselves (the abstract model; nothing is materialised)."""
        model = nnx.merge(self.graphdef, self.abstract_params, self.abstract_rest)
        out = set()
        for path, mod in nnx.iter_modules(model):
            names = tuple(str(p) for p in path)
            if isinstance(mod, Linear) and mod.fp8:
                out.add(names + ("kernel",))
            elif isinstance(mod, MoE) and mod.cfg.fp8 == "blockwise":
                out.update(names + (p,) for p in EXPERT_PROJS)
        return frozenset(out)


def abstract_model(model_cfg: ModelConfig, seed: int = 0):
    """(ModelFns, abstract params, abstract rest) without materialising a random init."""
    model = nnx.eval_shape(lambda: DeepSeekModel(model_cfg, rngs=nnx.Rngs(seed)))
    graphdef, ps, rs = nnx.split(model, nnx.Param, ...)
    return ModelFns(graphdef, ps, rs), ps.to_pure_dict(), rs.to_pure_dict()
