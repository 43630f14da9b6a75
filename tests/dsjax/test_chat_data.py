"""dsjax.data.chat: chat-template rendering and tokens equal transformers', assistant-only loss
masks (answer + EOS), packing, truncation counts, one-line errors for malformed JSONL."""
import json
import logging

import numpy as np
import pytest
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from dsjax.data import chat

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"

# DeepSeek-V3's chat_template (deepseek-ai/DeepSeek-V3, tokenizer_config.json), as published.
V3_TEMPLATE = (
    r"{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    r"{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}"
    r"{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    r"{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}"
    r"{%- else %}{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}"
    r"{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}"
    r"{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    r"{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}"
    r"{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}"
    r"{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}"
    r"{%- set ns.is_first = true -%}{%- else %}"
    r"{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}"
    r"{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}"
    r"{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}"
    r"{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"
    r"{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    r"{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    r"{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    r"{%- set ns.is_output_first = false %}{%- else %}"
    r"{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}"
    r"{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    r"{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
)
# DeepSeek-V2(-Lite)-Chat's chat_template: its generation prompt "Assistant:" has no trailing
# space, so the trained text of an answer starts with the space.
V2_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'User: ' + message['content'] + '\\n\\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ message['content'] + '\\n\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# The V3 template with the answer and its EOS in a {% generation %} block (as TRL's training
# template does), so transformers can give its own assistant mask.
V3_GENERATION = V3_TEMPLATE.replace(
    r"{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}",
    r"{%- else %}{{'<｜Assistant｜>'}}{% generation %}{{message['content'] + '<｜end▁of▁sentence｜>'}}{% endgeneration %}")
assert V3_GENERATION != V3_TEMPLATE

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "I am fine."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "It is four."},
     {"role": "user", "content": "And héllo wörld 日本語 🚀?"},
     {"role": "assistant", "content": "Hello,\n  there!\n\n"}],
    [{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
     {"role": "user", "content": "how are you"}, {"role": "assistant", "content": " two"},
     {"role": "user", "content": "I am"}, {"role": "assistant", "content": "fine"},
     {"role": "user", "content": "trailing question, no answer"}],
]


def _write_tokenizer(d, template, special_user_tokens=True, pad_token=None, bpe_vocab=400):
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    text = ["Hello there, how are you? I am fine. What is two plus two? It is four.",
            "User: Assistant:"]
    t.train_from_iterator(text * 3, trainers.BpeTrainer(
        vocab_size=bpe_vocab, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # in DeepSeek-V3's tokenizer.json the role markers are added tokens that are not special
    t.add_tokens([AddedToken(USER, special=False, normalized=False),
                  AddedToken(ASSISTANT, special=False, normalized=False)])
    d.mkdir(parents=True, exist_ok=True)
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
        "add_eos_token": False, "chat_template": template, "model_max_length": 4096,
        "bos_token": {"__type": "AddedToken", "content": BOS, "lstrip": False,
                      "normalized": True, "rstrip": False, "single_word": False},
        "eos_token": {"__type": "AddedToken", "content": EOS, "lstrip": False,
                      "normalized": True, "rstrip": False, "single_word": False},
        "pad_token": pad_token}, ensure_ascii=False))
    return d / "tokenizer.json"


@pytest.fixture(scope="module", params=["v3", "v2", "v3_generation"])
def fixture(request, tmp_path_factory):
    template = {"v3": V3_TEMPLATE, "v2": V2_TEMPLATE, "v3_generation": V3_GENERATION}[request.param]
    path = _write_tokenizer(tmp_path_factory.mktemp(request.param), template)
    return request.param, chat.ChatTokenizer.load(path)


@pytest.fixture(scope="module", params=["v3", "v3_generation"])
def v3_templates(request, tmp_path_factory):
    """The V3 templates without and with {% generation %} blocks (the V2 template has no
    generation-block version to compare with)."""
    template = {"v3": V3_TEMPLATE, "v3_generation": V3_GENERATION}[request.param]
    path = _write_tokenizer(tmp_path_factory.mktemp("gen_" + request.param), template)
    return request.param, chat.ChatTokenizer.load(path)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return chat.ChatTokenizer.load(_write_tokenizer(tmp_path_factory.mktemp("v3only"), V3_TEMPLATE))


def _hf(tok):
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(tok.path.parent))


def _ids(out):
    return list(out["input_ids"] if not isinstance(out, list) else out)


def test_render_and_tokens_match_transformers(fixture):
    name, tok = fixture
    hf = _hf(tok)
    for msgs in CONVERSATIONS:
        text = tok.template.render(msgs)
        assert text == hf.apply_chat_template(msgs, tokenize=False)
        for gen in (False, True):
            assert tok.template.render(msgs, add_generation_prompt=gen) == \
                hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        ids, _ = tok.encode_chat(msgs)
        assert ids.tolist() == _ids(hf.apply_chat_template(msgs, tokenize=True))


def test_mask_matches_transformers_generation_blocks(v3_templates):
    """transformers' return_assistant_tokens_mask needs {% generation %} blocks: compare on the
    V3 template that has them, and the prefix rule on the plain V3 template with that mask."""
    name, tok = v3_templates
    hf = _hf(tok)
    hf.chat_template = V3_GENERATION
    for msgs in CONVERSATIONS:
        out = hf.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        ids, trained = tok.encode_chat(msgs)
        assert ids.tolist() == list(out["input_ids"])
        assert trained.astype(int).tolist() == list(out["assistant_masks"])


def _runs(mask):
    """[(start, end)] of the runs of True in a bool vector."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def test_mask_is_each_answer_and_its_eos(fixture):
    """Independent derivation: the trained runs decode to exactly each answer + EOS (V2: with
    the space after "Assistant:"), in order; the untrained tokens decode to the rest."""
    name, tok = fixture
    for msgs in CONVERSATIONS:
        ids, trained = tok.encode_chat(msgs)
        answers = [m["content"] for m in msgs if m["role"] == "assistant"]
        want = [(" " if name == "v2" else "") + a + EOS for a in answers]
        runs = _runs(trained)
        got = [tok.tokenizer.decode(ids[s:e].tolist(), skip_special_tokens=False) for s, e in runs]
        assert got == want
        for s, e in runs:
            assert ids[e - 1] == tok.eos_id  # every answer ends with a trained EOS
            assert not trained[s - 1]  # the token before (generation prompt) is not trained
        text = tok.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        assert text == tok.template.render(msgs)


def test_prompt_completion_is_one_exchange(v3, tmp_path):
    f = tmp_path / "pc.jsonl"
    f.write_text(json.dumps({"prompt": "What is two plus two?", "completion": "It is four."}) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": "What is two plus two?"},
                                            {"role": "assistant", "content": "It is four."}]}) + "\n"
                 + json.dumps({"prompt": [{"role": "user", "content": "What is two plus two?"}],
                               "completion": [{"role": "assistant", "content": "It is four."}]}))
    ds = chat.build_dataset([f], v3, seq_len=64)
    assert len(ds) == 3
    for i in (1, 2):
        np.testing.assert_array_equal(ds.ids[0], ds.ids[i])
        np.testing.assert_array_equal(ds.trained[0], ds.trained[i])
    assert ds.where == [f"{f}:1", f"{f}:2", f"{f}:3"]


def _jsonl(path, convs):
    path.write_text("".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in convs))
    return path


def _many(n):
    return [[{"role": "user", "content": "how are you " * (i % 4 + 1)},
             {"role": "assistant", "content": f"I am fine {i}" + " two" * (i % 5)}]
            for i in range(n)]


def _check_batch(b, ds, B, T, eos_id, pad_id):
    """Check one batch against the contract; return the conversations (indices) it holds."""
    assert set(b) == {"inputs", "targets", "loss_mask", "segment_ids", "positions"}
    for k, dt in [("inputs", np.int32), ("targets", np.int32), ("loss_mask", np.float32),
                  ("segment_ids", np.int32), ("positions", np.int32)]:
        assert b[k].shape == (B, T) and b[k].dtype == dt
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    by_ids = {tuple(a.tolist()): k for k, a in enumerate(ds.ids)}
    held = []
    for r in range(B):
        seg, pos, m = b["segment_ids"][r], b["positions"][r], b["loss_mask"][r]
        full = np.concatenate([b["inputs"][r], b["targets"][r, -1:]])  # the row's T + 1 tokens
        for s in range(1, seg.max() + 1):
            idx = np.flatnonzero(seg == s)
            start = idx[0]
            np.testing.assert_array_equal(idx, np.arange(start, start + len(idx)))
            np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))
            # n tokens fill n input positions, or n - 1 when the conversation ends the row
            n = len(idx) + (idx[-1] == T - 1 and s == seg.max()
                            and tuple(full[start:start + len(idx) + 1].tolist()) in by_ids)
            k = by_ids[tuple(full[start:start + n].tolist())]
            held.append(k)
            np.testing.assert_array_equal(m[start:start + n - 1], ds.trained[k][1:])
            assert b["targets"][r, start + n - 2] == eos_id and m[start + n - 2] == 1.0
            if start + n - 1 < T:  # last token -> next conversation (or padding): no loss
                assert m[start + n - 1] == 0.0
        assert np.all(m[seg == 0] == 0) and np.all(b["inputs"][r][seg == 0] == pad_id)
    return held


def test_packed_batches(v3, tmp_path):
    """Rows hold whole conversations: segments separate (no loss across a boundary), positions
    restart, targets = next input, the final EOS of each answer trained; every conversation
    once per epoch; the batch contract of loader.py."""
    f = _jsonl(tmp_path / "c.jsonl", _many(37))
    T, B = 48, 3
    ds = chat.build_dataset([f], v3, seq_len=T)
    assert len(ds) == 37
    loader = chat.ChatLoader(ds, B, T, v3.pad_id, seed=1)
    held, n_batches = [], 0
    while loader.cursor[0] == 0:  # batches that start in epoch 0 (the last may reach epoch 1)
        held += _check_batch(next(loader), ds, B, T, v3.eos_id, v3.pad_id)
        n_batches += 1
    assert set(held) == set(range(len(ds))) and len(held) - len(ds) == loader.cursor[1]
    assert n_batches < len(ds)  # several conversations share a row
    val = [k for b in loader.iter_epoch_once() for k in _check_batch(b, ds, B, T, v3.eos_id,
                                                                    v3.pad_id)]
    assert sorted(val) == list(range(len(ds)))


def test_resume_and_validation_pass(v3, tmp_path):
    f = _jsonl(tmp_path / "c.jsonl", _many(23))
    ds = chat.build_dataset([f], v3, seq_len=40)
    a = chat.ChatLoader(ds, 2, 40, v3.pad_id, seed=3)
    for _ in range(5):
        next(a)
    state = json.loads(json.dumps(a.state()))
    want = [next(a) for _ in range(6)]
    b = chat.ChatLoader(ds, 2, 40, v3.pad_id, seed=3)
    b.restore(state)
    for w in want:
        got = next(b)
        for k in w:
            np.testing.assert_array_equal(w[k], got[k])
    with pytest.raises(ValueError, match="mismatch on 'lanes'"):
        chat.ChatLoader(ds, 4, 40, v3.pad_id, seed=3).restore(state)
    fewer = ds.subset(list(range(len(ds) - 1)))
    with pytest.raises(ValueError, match=rf"^loader state mismatch on 'num_docs': checkpoint has "
                                         rf"{len(ds)}, this loader {len(ds) - 1} \(the training "
                                         rf"files, or the validation split drawn from them, are "
                                         rf"not the checkpoint's\)$"):
        chat.ChatLoader(fewer, 2, 40, v3.pad_id, seed=3).restore(state)
    val = list(a.iter_epoch_once())
    n_segments = sum(int(v["segment_ids"][r].max()) for v in val for r in range(2))
    assert n_segments == len(ds)
    trained = sum(int(t[1:].sum()) for t in ds.trained)
    assert sum(float(v["loss_mask"].sum()) for v in val) == trained


def test_truncation_policies(v3, tmp_path, caplog):
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "fine"}]
    long_turns = [{"role": "system", "content": "S"}] + [
        m for i in range(6) for m in ({"role": "user", "content": "how are you " * 3},
                                      {"role": "assistant", "content": f"I am fine {i}"})]
    huge_answer = [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "two plus two " * 40}]
    f = _jsonl(tmp_path / "t.jsonl", [short, long_turns, huge_answer])
    T = 40
    n_long = len(v3.encode_chat(long_turns)[0])
    assert n_long > T + 1 and len(v3.encode_chat(short)[0]) <= T + 1
    with caplog.at_level(logging.WARNING, logger="dsjax.data.chat"):
        ds = chat.build_dataset([f], v3, seq_len=T, truncation="drop")
    assert (ds.stats.kept, ds.stats.dropped_too_long, ds.stats.truncated) == (1, 2, 0)
    assert "2 dropped as longer than 41 tokens" in caplog.text

    ds = chat.build_dataset([f], v3, seq_len=T, truncation="drop_turns")
    assert (ds.stats.kept, ds.stats.dropped_too_long, ds.stats.truncated) == (2, 1, 1)
    ids, trained = ds.ids[1], ds.trained[1]
    text = v3.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    assert text.startswith(BOS + "S" + USER) and text.endswith(ASSISTANT + "I am fine 5" + EOS)
    assert len(ids) <= T + 1 and trained[-1]

    ds = chat.build_dataset([f], v3, seq_len=T, truncation="cut_tail")
    assert (ds.stats.kept, ds.stats.dropped_too_long, ds.stats.truncated) == (3, 0, 2)
    assert all(len(i) <= T + 1 for i in ds.ids)
    np.testing.assert_array_equal(ds.ids[2], v3.encode_chat(huge_answer)[0][:T + 1])
    assert ds.stats.tokens == sum(len(i) for i in ds.ids)

    with pytest.raises(ValueError, match="expected one of drop, drop_turns, cut_tail"):
        chat.build_dataset([f], v3, seq_len=T, truncation="left")


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('["a"]', "expected a JSON object"),
    ('{"text": "x"}', "expected 'messages', or 'prompt' and 'completion'"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": [{"content": "x"}]}', r"messages\[0\] has no 'role'"),
    ('{"messages": [{"role": "bot", "content": "x"}]}',
     "role 'bot' is not one of system, user, assistant"),
    ('{"messages": [{"role": "user"}]}', r"messages\[0\] \(user\) has no 'content'"),
    ('{"messages": [{"role": "user", "content": 3}]}', "'content' of type int"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
    ('{"prompt": "x", "completion": 3}', "must both be strings"),
])
def test_malformed_lines_name_file_and_line(v3, tmp_path, line, message):
    f = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "a", "completion": "b"})
    f.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(ValueError, match=message) as e:
        chat.build_dataset([f], v3, seq_len=32)
    msg = str(e.value)
    assert msg.startswith(f"{f}:3: ") and "\n" not in msg


def test_template_errors_name_the_line(tmp_path):
    raising = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
               "{{ raise_exception('system must come first') }}{% endif %}{{ m['content'] }}"
               "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")
    tok = chat.ChatTokenizer.load(_write_tokenizer(tmp_path / "r", raising))
    f = _jsonl(tmp_path / "c.jsonl", [CONVERSATIONS[0], [{"role": "user", "content": "x"},
                                                         {"role": "system", "content": "y"},
                                                         {"role": "assistant", "content": "z"}]])
    with pytest.raises(ValueError, match=f"{f}:2: chat template error: system must come first"):
        chat.build_dataset([f], tok, seq_len=32)
    # a template that renders an answer differently once more turns follow has no prefix rule
    unstable = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}"
                "{% if loop.last %}{{ eos_token }}{% else %}|{% endif %}{% endif %}{% endfor %}")
    tok = chat.ChatTokenizer.load(_write_tokenizer(tmp_path / "u", unstable))
    f = _jsonl(tmp_path / "d.jsonl", [CONVERSATIONS[1]])
    with pytest.raises(ValueError, match=f"{f}:1: the chat template renders message 2 differently"):
        chat.build_dataset([f], tok, seq_len=64)


def test_pad_token_absent_is_eos_with_one_warning_else_checked(tmp_path, caplog):
    # case 3 on the chat path: no pad_token -> EOS, said once per tokenizer file (the
    # answers' EOS stay trained: test_mask_is_each_answer_and_its_eos); a pad_token is used
    # when it is a token of the file, and one that is not is an error naming it
    path = _write_tokenizer(tmp_path / "nopad", V3_TEMPLATE)
    with caplog.at_level(logging.WARNING, logger="dsjax.data.tokenizer"):
        tok = chat.ChatTokenizer.load(path)
        chat.ChatTokenizer.load(path)
    assert tok.pad_id == tok.eos_id
    assert len([r for r in caplog.records if "pad token == EOS" in r.message and str(path) in r.message]) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dsjax.data.tokenizer"):
        tok = chat.ChatTokenizer.load(_write_tokenizer(tmp_path / "bospad", V3_TEMPLATE, pad_token=BOS))
    assert tok.pad_id == tok.tokenizer.token_to_id(BOS) != tok.eos_id
    assert not [r for r in caplog.records if "pad token == EOS" in r.message]
    with pytest.raises(ValueError, match="pad_token '<pad>' is not a token of"):
        chat.ChatTokenizer.load(_write_tokenizer(tmp_path / "badpad", V3_TEMPLATE, pad_token="<pad>"))


def test_missing_template(tmp_path):
    path = _write_tokenizer(tmp_path, None)
    with pytest.raises(ValueError, match="no chat_template"):
        chat.ChatTokenizer.load(path)
    (tmp_path / "chat_template.jinja").write_text(V2_TEMPLATE)
    assert chat.ChatTokenizer.load(path).template.text == V2_TEMPLATE


@pytest.mark.parametrize("overrides, needle", [
    (["data.format=chats"], "data.format='chats': expected one of text, chat"),
    (["data.format=chat", "data.train=a.jsonl", "data.chat_truncation=left"],
     "data.chat_truncation='left': expected one of drop, drop_turns, cut_tail"),
    (["data.format=chat", "data.train=a.jsonl"], "data.format=chat needs data.tokenizer"),
    (["data.format=chat", "data.tokenizer=t.json"], "data.format=chat needs data.train"),
])
def test_config_errors(overrides, needle):
    from dsjax import config as C
    with pytest.raises(C.ConfigError, match=needle) as e:
        C.load(None, overrides)
    assert "\n" not in str(e.value)
    cfg = C.load(None, ["data.format=chat", "data.train=a.jsonl", "data.tokenizer=t.json",
                        "data.chat_truncation=drop_turns"])
    assert (cfg.data.format, cfg.data.chat_truncation) == ("chat", "drop_turns")
    assert C.load(None, []).data.format == "text"


def test_build_loaders_holds_out_validation(v3, tmp_path):
    f = _jsonl(tmp_path / "c.jsonl", _many(60))
    tok, train, val = chat.build_loaders([f], [], v3.path, seq_len=48, rows=4, val_rows=2,
                                         val_fraction=0.25, truncation="drop_turns")
    assert len(train.ds) + len(val.ds) == 60 and 0 < len(val.ds) < 30
    assert not set(train.ds.where) & set(val.ds.where)
    # the split follows the file's name and line, not the directory it was read from
    moved = tmp_path / "elsewhere" / "c.jsonl"
    moved.parent.mkdir()
    moved.write_bytes(f.read_bytes())
    again = chat.build_loaders([moved], [], v3.path, seq_len=48, rows=4, val_rows=2,
                               val_fraction=0.25, truncation="drop_turns")[2]
    assert [w.split(":")[-1] for w in again.ds.where] == [w.split(":")[-1] for w in val.ds.where]
    b = next(train)
    assert b["inputs"].shape == (4, 48) and b["loss_mask"].sum() > 0
    # two processes: each gets its half of the same global batch
    halves = [chat.build_loaders([f], [], v3.path, seq_len=48, rows=4, val_rows=2,
                                 process_index=i, process_count=2)[1] for i in range(2)]
    whole = chat.build_loaders([f], [], v3.path, seq_len=48, rows=4, val_rows=2)[1]
    w, parts = next(whole), [next(h) for h in halves]
    for k in w:
        np.testing.assert_array_equal(w[k], np.concatenate([p[k] for p in parts]))


def test_loaders_from_config(v3, tmp_path):
    from dsjax import config as C
    _jsonl(tmp_path / "train.jsonl", _many(20))
    _jsonl(tmp_path / "val.jsonl", _many(5))
    cfg = C.load(None, ["data.format=chat", f"data.train={tmp_path}/train.jsonl",
                        f"data.validation={tmp_path}/val.jsonl", f"data.tokenizer={v3.path}",
                        "data.seq_len=48", "data.batch_size=2", "data.chat_truncation=cut_tail"])
    tok, train, val = chat.loaders_from_config(cfg.data, rows=4)
    assert tok.vocab_size == v3.vocab_size and tok.path == v3.path
    assert (len(train.ds), len(val.ds), train.batch_size, val.batch_size) == (20, 5, 4, 2)
    assert next(train)["inputs"].shape == (4, 48)


def test_special_token_text_in_content_is_counted(v3, tmp_path, caplog):
    conv = [{"role": "user", "content": "say " + EOS},
            {"role": "assistant", "content": "ok " + EOS + " done"}]
    f = _jsonl(tmp_path / "s.jsonl", [conv, CONVERSATIONS[0]])
    with caplog.at_level(logging.WARNING, logger="dsjax.data.chat"):
        ds = chat.build_dataset([f], v3, seq_len=64)
    assert ds.stats.control_text == 1
    assert "1 with special-token text inside a message" in caplog.text
    hf = _hf(v3)
    assert ds.ids[0].tolist() == _ids(hf.apply_chat_template(conv, tokenize=True))


def test_chat_training_run(tmp_path):
    """`python -m dsjax.train` on chat JSONL: the loop takes the chat loaders, trains on the
    assistant tokens only and keeps the template beside the run's tokenizer."""
    from dsjax import config as C
    from dsjax.train.loop import train
    # the model, batch and schedule of test_generate.py's and test_reliability.py's runs
    # (vocabulary 300, 2 layers, 4 rows of 32 tokens, optim.decay_steps=12): one train step and
    # one eval step program for all of them (conftest.py's compilation cache). The V3 template's
    # tokenizer with a smaller BPE, so that its tokens with the role markers fit 300
    tok = chat.ChatTokenizer.load(_write_tokenizer(tmp_path / "tok", V3_TEMPLATE, bpe_vocab=298))
    assert tok.vocab_size <= 300
    _jsonl(tmp_path / "train.jsonl", _many(24))  # conversations of 14 to 28 tokens
    _jsonl(tmp_path / "val.jsonl", _many(4))
    run = tmp_path / "run"
    cfg = C.load("configs/tiny.yaml", [
        "data.format=chat", f"data.train={tmp_path}/train.jsonl", f"data.validation={tmp_path}/val.jsonl",
        f"data.tokenizer={tok.path}", "data.seq_len=32", "data.batch_size=4", "train.steps=3",
        "train.eval_every=3", "train.eval_batches=1", "train.log_every=1", "checkpoint.every=3",
        "model.vocab_size=300", "model.num_hidden_layers=2", "optim.decay_steps=12", f"train.run_dir={run}",
        "train.tensorboard=false"])
    summary = train(cfg)
    val = {int(k): v for k, v in summary["val_loss"].items()}
    assert summary["steps"] == 3 and sorted(val) == [0, 3] and np.isfinite(val[3])
    assert (run / "tokenizer.json").read_bytes() == tok.path.read_bytes()
    assert (run / "tokenizer_config.json").is_file()
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r and "step" in r]
    assert steps and all(np.isfinite(r["loss"]) for r in steps)


# ---------------------------------------------------------------- Parquet and bad inputs

def _chat_parquet(path, columns, row_group_size=5):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def test_parquet_conversations_equal_jsonl_and_resume_bitwise(v3, tmp_path, monkeypatch):
    from dsjax.data import parquet
    monkeypatch.setattr(parquet, "_BATCH_ROWS", 4)  # record batches within 5-row row groups
    convs = _many(21) + [CONVERSATIONS[1]]
    convs[3] = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "fine", "reasoning_content": "two plus two"}]
    jl = _jsonl(tmp_path / "c.jsonl", convs)
    pq_path = _chat_parquet(tmp_path / "c.parquet", {"messages": convs, "n": list(range(22))})
    dj, dp = chat.build_dataset([jl], v3, seq_len=96), chat.build_dataset([pq_path], v3, seq_len=96)
    assert len(dp) == len(dj) == 22 and dp.where[7] == f"{pq_path}:row 7"
    for a, b, c, d in zip(dj.ids, dp.ids, dj.trained, dp.trained):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, d)
    pairs = [("how are you", "I am fine"), ("What is two plus two?", "It is four.")] * 3
    pc = _chat_parquet(tmp_path / "pc.parquet", {"prompt": [p for p, _ in pairs],
                                                   "completion": [c for _, c in pairs]}, 4)
    pcj = tmp_path / "pc.jsonl"
    pcj.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))
    assert [x.tolist() for x in chat.build_dataset([pc], v3, seq_len=96).ids] == \
        [x.tolist() for x in chat.build_dataset([pcj], v3, seq_len=96).ids]
    # resume: the saved position of a loader over Parquet rows continues bitwise
    a = chat.ChatLoader(dp, 2, 96, v3.pad_id, seed=5)
    for _ in range(4):
        next(a)
    state = json.loads(json.dumps(a.state()))
    want = [next(a) for _ in range(7)]  # crosses an epoch boundary
    b = chat.ChatLoader(chat.build_dataset([pq_path], v3, seq_len=96), 2, 96, v3.pad_id, seed=5)
    b.restore(state)
    for w in want:
        got = next(b)
        for k in w:
            np.testing.assert_array_equal(w[k], got[k])


def test_parquet_chat_bad_inputs_name_the_file(v3, tmp_path):
    good = _jsonl(tmp_path / "good.jsonl", _many(3))
    cols = _chat_parquet(tmp_path / "cols.parquet", {"text": ["a"], "id": [1]})
    with pytest.raises(ValueError) as e:  # found before the tokenizer is loaded or anything read
        chat.build_loaders([good], [cols], tmp_path / "no-such-tokenizer.json", seq_len=32,
                           rows=2, val_rows=2)
    assert str(e.value) == (f"{cols}: chat data (data.format=chat) needs a 'messages' column, or "
                            f"'prompt' and 'completion' columns; its columns are text, id")
    rows = _many(4)
    rows[2] = [{"content": "no role"}, {"role": "assistant", "content": "x"}]
    bad = _chat_parquet(tmp_path / "bad.parquet", {"messages": rows}, 2)
    with pytest.raises(ValueError, match=f"^{bad}:row 2: messages\\[0\\] has no 'role'$"):
        chat.build_dataset([bad], v3, seq_len=32)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1" + np.random.default_rng(1).bytes(100) + b"PAR1")
    with pytest.raises(ValueError, match=f"^{junk}: not a readable Parquet file"):
        chat.build_dataset([good, junk], v3, seq_len=32)


def test_non_utf8_chat_line_names_file_and_line(v3, tmp_path):
    f = tmp_path / "c.jsonl"
    line = json.dumps({"prompt": "café", "completion": "ok"}, ensure_ascii=False)
    f.write_bytes(json.dumps({"messages": CONVERSATIONS[0]}).encode() + b"\n"
                  + line.encode("latin-1") + b"\n")
    with pytest.raises(ValueError, match=f"^{f}:2: not UTF-8 text \\(byte 0xe9 at column 16\\)"):
        chat.build_dataset([f], v3, seq_len=64)


def test_sources_with_nothing_to_train_on_name_each_file_and_why(v3, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n\n")
    long = _jsonl(tmp_path / "long.jsonl", [[{"role": "user", "content": "how are you " * 9},
                                             {"role": "assistant", "content": "fine " * 9}]] * 2)
    with pytest.raises(ValueError) as e:
        chat.build_loaders([empty, blank, long], [], v3.path, seq_len=16, rows=2, val_rows=2)
    assert str(e.value) == (
        f"data.train: no conversations left to train on: {empty} is empty; {blank} is empty; "
        f"{long}: all 2 conversations dropped, 2 longer than data.seq_len=16 allows (17 tokens; "
        f"data.chat_truncation=drop)")
    good = _jsonl(tmp_path / "good.jsonl", _many(6))
    with pytest.raises(ValueError, match=f"^data.validation: no conversations left to train on: "
                                         f"{blank} is empty$"):
        chat.build_loaders([good], [blank], v3.path, seq_len=48, rows=2, val_rows=2)
    one = _jsonl(tmp_path / "one.jsonl", _many(1))
    with pytest.raises(ValueError, match="all 1 were held out for validation by data.val_fraction=0.99"):
        chat.build_loaders([one], [], v3.path, seq_len=48, rows=2, val_rows=2, val_fraction=0.99)


def test_template_syntax_errors_name_the_source_and_line(tmp_path):
    broken = "{% for m in messages %}\n{{ m['content'] }}\n{% if m['role'] %}x{% endfo %}\n"
    path = _write_tokenizer(tmp_path / "cfg", broken)
    with pytest.raises(ValueError) as e:
        chat.ChatTokenizer.load(path)
    cfg = tmp_path / "cfg" / "tokenizer_config.json"
    assert str(e.value).startswith(f"{cfg}: chat_template line 3: syntax error: Encountered "
                                   f"unknown tag 'endfo'") and "\n" not in str(e.value)
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{{ bos_token }}\n{% for m in messages %}{{ m['content'] }\n{% endfor %}")
    with pytest.raises(ValueError, match=f"^{jinja}:2: chat template syntax error: ") as e:
        chat.ChatTokenizer.load(_write_tokenizer(tmp_path / "j", V3_TEMPLATE), jinja)
    assert "\n" not in str(e.value)


def test_bad_tokenizer_files_name_the_file(tmp_path):
    path = _write_tokenizer(tmp_path / "t", V3_TEMPLATE)
    cfg = tmp_path / "t" / "tokenizer_config.json"
    good = cfg.read_text(encoding="utf-8")
    cfg.write_text('{"chat_template": "x",\n  "eos_token": }\n')
    with pytest.raises(ValueError, match=f"^{cfg}:2:16: not valid JSON \\(Expecting value\\)$"):
        chat.ChatTokenizer.load(path)
    cfg.write_bytes(good.replace('"model_max_length"', '"caf\xe9"').encode("latin-1", "replace"))
    with pytest.raises(ValueError, match=f"^{cfg}:1: not UTF-8 text \\(byte 0x"):
        chat.ChatTokenizer.load(path)
    cfg.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"^{cfg}: expected a JSON object, got list$"):
        chat.ChatTokenizer.load(path)
    cfg.write_text(good, encoding="utf-8")
    chat.ChatTokenizer.load(path)
    path.write_text(path.read_text()[:500])
    with pytest.raises(ValueError, match=f"^{path}: not a readable tokenizer.json \\("):
        chat.ChatTokenizer.load(path)


def test_empty_chat_file_through_the_cli(tmp_path, monkeypatch, capsys):
    import sys
    from pathlib import Path

    from dsjax.cli import run_main
    from dsjax.train.__main__ import main as train_main
    tok = _write_tokenizer(tmp_path / "tok", V3_TEMPLATE, bpe_vocab=298)
    empty = tmp_path / "train.jsonl"
    empty.write_text("\n\n")
    root = Path(__file__).resolve().parents[2]
    sets = ["data.format=chat", f"data.train=[{empty}]", f"data.tokenizer={tok}",
            f"train.run_dir={tmp_path / 'run'}", "model.vocab_size=300"]
    monkeypatch.setattr(sys, "argv", ["dsjax.train", "--config", str(root / "configs" / "tiny.yaml"),
                                      *[a for s in sets for a in ("--set", s)]])
    with pytest.raises(SystemExit) as ex:
        run_main("dsjax.train", train_main)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert ex.value.code == 2 and lines == [
        f"dsjax.train: error: data.train: no conversations left to train on: {empty} is empty"]
    assert not (tmp_path / "run").exists()
