"""`dsjax.convert --to-hf` of a LoRA chat run (the README's CPU LoRA demo's targets): HF
`generate` stops where `dsjax.generate` stops, PEFT loads the adapter with the merged model's
logits, and every written file gets the umask's mode."""
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import jax
import numpy as np

from dsjax.hf import save_hf

import torch  # noqa: E402  the test extra: missing torch/transformers fails loudly, never skips
import transformers  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import hf_parity as P  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _chat_run(tmp_path: Path, sets: list[str]):
    """A LoRA chat run directory with a 'trained' step-0 checkpoint (random adapter B): a
    300-token byte-level BPE whose <|endoftext|> (id 0) ends the answers, the stdlib demo's chat
    template and special tokens, and an lm_head whose EOS column is the column of the 4th token
    that greedy decoding answers, scaled to a 5 % larger logit, so the answer stops after a few
    tokens.
    Returns (run dir, prompt ids [P], EOS id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from dsjax import config as C
    from dsjax import generate as G
    from dsjax.checkpoint import Checkpointer
    from dsjax.data.stdlib_qa import CHAT_TEMPLATE
    from dsjax.model import abstract_model
    from dsjax.model.lora import merged_params
    from dsjax.train import finetune, runs
    from dsjax.train.optim import build_optimizer

    sys.path.insert(0, str(ROOT / "tests"))
    from _tiny import tiny_model

    run = tmp_path / "run"
    run.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [json.__doc__, os.__doc__, shutil.__doc__, "What does `json.dumps` do?"]
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(run / "tokenizer.json"))
    (run / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
         "pad_token": "<|pad|>", "chat_template": CHAT_TEMPLATE}))
    cfg = C.load(ROOT / "configs" / "tiny.yaml", tiny_model(vocab=320, layers=3, heads=2, experts=4) + [
        "model.initializer_range=0.1", f"train.run_dir={run}", "mesh.fsdp=1", "mesh.devices=1"] + sets)
    _, params, rest = finetune.init_model(cfg, seed=3)
    leaves, tdef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree_util.tree_unflatten(tdef, [
        jax.random.normal(k, x.shape, x.dtype) * 0.3 if str(p[-1].key) == "lora_B" else x
        for k, (p, x) in zip(keys, leaves)])
    ids, eos = G.chat_prompt(run, cfg, "What does `json.dumps` do?")
    fns, _, _ = abstract_model(cfg.model)
    model = fns.merge(merged_params(params, cfg.lora), rest)
    free, _ = G.generate(model, ids[None], 4)
    logit = float(jax.jit(lambda t: model(t)[0])(free[:, :-1])[0, -1, free[0, -1]])  # the 4th's
    t, scale = int(free[0, -1]), 1 + 0.05 * np.sign(logit)
    head = params["lm_head"]  # its kernel [D, V] and, when adapted, its lora_B [r, V]
    for leaf, cols in (("kernel", head), ("lora_B", head.get("lora", {}))):
        if leaf in cols:
            cols[leaf] = cols[leaf].at[:, eos].set(cols[leaf][:, t] * scale)
    tx, _ = build_optimizer(cfg.optim, 1)
    ck = Checkpointer(run / "checkpoints", dataclasses.replace(cfg.checkpoint, async_save=False))
    ck.save(0, runs.make_state(cfg, params, rest, tx), {}, C.to_dict(cfg))
    ck.wait()
    ck.close()
    return run, ids, eos


def test_to_hf_chat_lora_run_generation_stops_peft_loads_and_modes(tmp_path):
    """The README's CPU LoRA demo's export (every projection and routed expert, dropout 0.05,
    plus lm_head): HF greedy `generate` on the merged export gives dsjax.generate's tokens and
    stops at the same EOS from the exported config alone; `PeftModel.from_pretrained` on the
    base model with OUT/adapter gives the merged model's logits; every file written has the
    mode the umask gives (0640 under umask 027)."""
    import peft
    from dsjax import convert
    from dsjax import generate as G
    from dsjax.model.lora import split_adapters

    run, ids, eos = _chat_run(tmp_path, ["lora.rank=4", "lora.alpha=8", "lora.dropout=0.05",
                                         "lora.target_modules=[all-linear, lm_head]"])
    old = os.umask(0o027)
    try:
        out = convert.to_hf(run, tmp_path / "hf", dtype="float32")
    finally:
        os.umask(old)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert {p.relative_to(out).as_posix() for p in files} >= {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json", "adapter/adapter_model.safetensors", "adapter/adapter_config.json"}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: "0o640" for p in files}

    # generation: dsjax's greedy answer stops at EOS after a few tokens; HF's is the same
    cfg_json = json.loads((out / "config.json").read_text())
    gen_json = json.loads((out / "generation_config.json").read_text())
    want = {"bos_token_id": None, "eos_token_id": 0, "pad_token_id": 1}
    assert {k: cfg_json[k] for k in want} == want and gen_json == want and eos == 0
    model, _, _, _ = G.load_run(run)
    N = 16
    ours, _ = G.generate(model, ids[None], N, eos_id=eos)
    stop = ours.shape[1] - len(ids)
    assert ours[0, -1] == eos and 2 <= stop < N and eos not in ours[0, len(ids):-1].tolist(), ours
    hf = P.load_eager(out)
    htok = transformers.AutoTokenizer.from_pretrained(out)
    rendered = htok.apply_chat_template([{"role": "user", "content": "What does `json.dumps` do?"}],
                                        add_generation_prompt=True, tokenize=False)
    assert htok(rendered, add_special_tokens=False)["input_ids"] == ids.tolist()
    assert htok.eos_token_id == eos and htok.pad_token_id == 1
    with torch.no_grad():
        theirs = hf.generate(torch.as_tensor(ids[None], dtype=torch.long), max_new_tokens=N,
                             do_sample=False).numpy()
    np.testing.assert_array_equal(theirs, ours)

    # PEFT: base model + OUT/adapter = the merged model
    conf = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert conf["lora_dropout"] == 0.0 and conf["r"] == 4 and conf["lora_alpha"] == 8
    assert "model.layers.0.mlp.gate_proj.weight" in conf["target_parameters"]
    cfg, params, rest, _ = convert.restore_params(run)
    save_hf(tmp_path / "base", cfg.model, split_adapters(params)[0], rest, dtype="float32")
    toks = np.random.default_rng(5).integers(2, cfg.model.vocab_size, (2, 32))
    with torch.no_grad():
        t = torch.as_tensor(toks, dtype=torch.long)
        merged = hf(t).logits.float().numpy()
        base = P.load_eager(tmp_path / "base")
        plain = base(t).logits.float().numpy()
        with_adapter = peft.PeftModel.from_pretrained(base, str(out / "adapter")).eval()
        theirs = with_adapter(t).logits.float().numpy()
    assert P.rel(plain, merged) > 1e-1  # the adapters matter, those of the MLPs and experts too
    assert P.rel(theirs, merged) <= 1e-5
