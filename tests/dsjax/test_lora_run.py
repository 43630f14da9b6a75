"""A LoRA fine-tuning run end to end on chat data from the standard library's docstrings:
train.init_from a base run (frozen weights bitwise the base's), resume bitwise (with adapter
dropout) without the base run, `--to-hf` merged export that transformers reproduces, PEFT adapter files, and a chat
answer through the run's template."""
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dsjax import config as C
from dsjax import convert, generate as G
from dsjax.checkpoint import Checkpointer
from dsjax.data import stdlib_qa
from dsjax.model.lora import merged_params
from dsjax.train import finetune, loop, runs
from dsjax.train.optim import build_optimizer

import torch  # noqa: E402,F401  the test extra: missing torch/transformers fails loudly
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
import hf_parity as P  # noqa: E402
from _tiny import tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = tiny_model(vocab=320, layers=3, heads=2, experts=4)


@pytest.fixture(scope="module")
def qa(tmp_path_factory):
    """stdlib QA conversations + a 300-token byte-level BPE with the demo's chat template."""
    d = tmp_path_factory.mktemp("qa")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in stdlib_qa.conversations(("json", "textwrap")) for m in c["messages"]]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "src_tokenizer.json"))
    n = stdlib_qa.write(d, d / "src_tokenizer.json", val_percent=10)
    assert n["train"] > 1000 and n["val"] > 50
    return d


def cfg_for(qa, run, *sets):
    return C.load(ROOT / "configs" / "tiny.yaml", MODEL + [
        "data.format=chat", f"data.train=[{qa}/train.jsonl]", "data.validation=[]", "data.val_fraction=0",
        f"data.tokenizer={qa}/tokenizer.json", "data.seq_len=128", "data.batch_size=4",
        "optim.warmup_steps=0", "optim.learning_rate=1e-2", f"train.run_dir={run}", "train.progress=false",
        "train.tensorboard=false", "train.log_every=1", "train.eval_every=1000", "train.eval_batches=1",
        "mesh.fsdp=1", "mesh.devices=1"] + list(sets))


def metrics(run):
    return [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def test_lora_run_from_base_resume_export_and_chat(qa, tmp_path):
    base = tmp_path / "base"  # a base run's step-0 checkpoint (as `dsjax.convert --from-hf` writes)
    bcfg = cfg_for(qa, base, "model.initializer_range=0.1")
    _, p0, r0 = finetune.init_model(bcfg, seed=3)
    tx, _ = build_optimizer(bcfg.optim, 1)
    ck = Checkpointer(base / "checkpoints", dataclasses.replace(bcfg.checkpoint, async_save=False))
    ck.save(0, runs.make_state(bcfg, p0, r0, tx), {}, C.to_dict(bcfg))
    ck.wait()
    ck.close()
    # a base run's numerics and kernel switches may differ from this run's, its model may not
    runs.load_base_run(base, cfg_for(qa, tmp_path / "x", "model.moe_recompute=true", "model.remat=full"))
    with pytest.raises(C.ConfigError, match=r"model.rms_norm_eps=1e-05 but the checkpoint has 1e-06"):
        runs.load_base_run(base, cfg_for(qa, tmp_path / "x", "model.rms_norm_eps=1e-5"))
    lora = ["lora.rank=4", "lora.alpha=8", "lora.dropout=0.1", "lora.target_modules=[all-linear, lm_head]",
            f"train.init_from={base}", "train.steps=4", "checkpoint.every=2"]
    a = cfg_for(qa, tmp_path / "a", *lora)
    loop.train(a)
    # frozen weights are the base run's, bitwise; adapters trained
    _, pb, rb, _ = runs.restore_run(base)
    ca, pa, ra, step = runs.restore_run(a.train.run_dir)
    assert step == 4 and ca.lora.rank == 4
    b_a, ads = finetune.base_and_adapters(pa)
    for x, y in zip(jax.tree.leaves(b_a), jax.tree.leaves(pb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert any(float(jnp.max(jnp.abs(x))) > 0 for p, x in jax.tree_util.tree_flatten_with_path(ads)[0]
               if str(p[-1].key) == "lora_B")
    recs = [r for r in metrics(a.train.run_dir) if "loss" in r]
    assert recs[-1]["tokens_trained"] > 0 and recs[-1]["tokens_masked"] > 0
    assert recs[-1]["grad_norm/adapters"] > 0 and "grad_norm/adapters/routed_experts" in recs[-1]
    assert "grad_norm/embed" not in recs[-1]  # nothing of the base trains

    # resume: the same run interrupted after step 2 continues bitwise (dropout keys included),
    # without its train.init_from base run (moved away): the checkpoint holds the frozen weights
    b_dir = tmp_path / "b"
    (b_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "2", b_dir / "checkpoints" / "2")
    base.rename(tmp_path / "base_moved")
    loop.train(cfg_for(qa, b_dir, *lora), resume=True)
    la = {r["step"]: r["loss"] for r in recs}
    lb = {r["step"]: r["loss"] for r in metrics(b_dir) if "loss" in r}
    assert sorted(lb) == [3, 4] and all(la[s] == lb[s] for s in (3, 4)), (la, lb)
    _, pb2, _, _ = runs.restore_run(b_dir)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb2)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    # export: merged weights that transformers reproduces, and the adapters alone (PEFT keys)
    out = convert.to_hf(a.train.run_dir, tmp_path / "hf", dtype="float32")
    toks = jnp.asarray(np.random.default_rng(0).integers(2, 300, (2, 48)), jnp.int32)
    fns, _, _ = finetune.abstract_model(ca)
    # the LoRA model (adapter GEMMs, no merge), jitted: one compile instead of its eager ops' many
    ours = np.asarray(jax.jit(lambda p, r, t: fns.merge(p, r)(t)[0])(pa, ra, toks))
    model, _, _, _ = G.load_run(a.train.run_dir)  # generation's merged model
    merged = np.asarray(jax.jit(lambda t: model(t)[0])(toks))  # jitted, like the LoRA model
    np.testing.assert_allclose(merged, ours, rtol=0, atol=1e-5 * np.abs(ours).max())
    hf = P.load_eager(out)
    with torch.no_grad():
        theirs = hf(torch.as_tensor(np.asarray(toks), dtype=torch.long)).logits.float().numpy()
    assert P.rel(ours, theirs) <= 1e-5
    ad = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    conf = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 8.0
    E = ca.model.n_routed_experts
    pre = "base_model.model.model.layers"
    assert f"{pre}.0.self_attn.q_a_proj.lora_A.weight" in ad and f"{pre}.0.mlp.gate_proj.lora_B.weight" in ad
    assert f"{pre}.2.mlp.shared_experts.down_proj.lora_A.weight" in ad
    assert "base_model.model.lm_head.lora_B.weight" in ad
    for j in range(E):  # per expert, transposed to torch's [out, in] convention
        k = f"{pre}.2.mlp.experts.{j}.up_proj"
        A, B = ads["moe_layers"]["mlp"]["experts"]["up_proj"]["lora_A"], ads["moe_layers"]["mlp"]["experts"]["up_proj"]["lora_B"]
        np.testing.assert_array_equal(ad[f"{k}.lora_A.weight"], np.asarray(A[1, j]).T)
        np.testing.assert_array_equal(ad[f"{k}.lora_B.weight"], np.asarray(B[1, j]).T)
    n_mod = 3 * (5 + 3) + 2 * (3 * E) + 1  # 3 layers x (5 attn + 3 MLP) + 2 MoE layers x 3E experts + head
    assert len(ad) == 2 * n_mod
    import re
    pat = conf["target_modules"]
    assert re.fullmatch(pat, "model.layers.7.mlp.experts.3.down_proj") and not re.fullmatch(pat, "model.layers.1.mlp.gate")
    # merged base params really fold the adapters (differ from the base)
    mp = merged_params(pa, ca.lora)
    assert not np.array_equal(np.asarray(mp["lm_head"]["kernel"]), np.asarray(pb["lm_head"]["kernel"]))

    # chat: the user message rendered with the run's template and the generation prompt
    ids, eos = G.chat_prompt(a.train.run_dir, ca, "What does `json.dumps` do?")
    text = Tokenizer.from_file(str(Path(a.train.run_dir) / "tokenizer.json")).decode(ids.tolist())
    assert text == "User: What does `json.dumps` do?\n\nAssistant:" and eos == 0
    out_ids, _ = G.generate(model, ids[None], 6, eos_id=eos)
    assert out_ids.shape[1] > len(ids)
