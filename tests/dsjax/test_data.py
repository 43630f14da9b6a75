"""dsjax.data: corpus split, sources, BPE tokenizer + cache, packed resumable loader."""
import json
import logging
import os

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dsjax.data import corpus, tokenizer
from dsjax.data.corpus import Documents, resolve_sources, split_files, stdlib_files
from dsjax.data.loader import PackedLoader
from dsjax.data.tokenizer import load_or_train

SAMPLES = [
    "plain ASCII text, with punctuation!?",
    "unicode: héllo wörld — ünïcödé ✓ 日本語のテキスト 🚀🐍 e\u0301 \u200b",
    "def f(x):\n\tif x:\n\t\treturn x  # tab\r\n    else:\n        return None\n\n\n",
    "  leading and trailing spaces  ",
    "nul \x00 and controls \x07\x1b[0m",
    "literal <|endoftext|> and <|pad|> inside a document",
    "",
]


def _docs(n=40):
    return [f"def func_{i}(x):\n\treturn x * {i} + 'é'\n" * (i % 7 + 1) for i in range(n)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = [corpus.read_text(p) for p in stdlib_files()[:8]] + _docs() + SAMPLES
    d = tmp_path_factory.mktemp("tok")
    return load_or_train(d, 400, lambda: iter(texts), fingerprint="test")


@pytest.fixture(scope="module")
def eos_pad_tok(tmp_path_factory):
    """A 'user' tokenizer whose only special token is </s>: pad falls back to EOS."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(_docs(), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("user") / "tokenizer.json"
    t.save(str(path))
    return path


# ---------------------------------------------------------------- tokenizer

def test_round_trip(tok):
    for s in SAMPLES:
        assert tok.decode(tok.encode(s)) == s
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]
    assert tok.eos_id == 0 and tok.pad_id == 1 and tok.vocab_size <= 400
    # Special-token strings inside text are plain text: they never fake a document boundary.
    assert tok.eos_id not in tok.encode(SAMPLES[5]) and tok.pad_id not in tok.encode(SAMPLES[5])


def test_cache_reuse(tmp_path, monkeypatch):
    calls = []
    real = tokenizer.train_bpe
    monkeypatch.setattr(tokenizer, "train_bpe", lambda *a, **k: calls.append(1) or real(*a, **k))
    files = stdlib_files()[:3]
    t1 = load_or_train(tmp_path, 300, Documents(files))
    mtime = os.stat(t1.path).st_mtime_ns
    t2 = load_or_train(tmp_path, 300, Documents(files))
    assert calls == [1] and t2.path == t1.path and os.stat(t2.path).st_mtime_ns == mtime
    assert t1.path.name.startswith("bpe_300_") and t1.path.parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [t1.path.name]  # no temp files left
    load_or_train(tmp_path, 300, Documents(stdlib_files()[:4]))  # other files -> new key
    load_or_train(tmp_path, 320, Documents(files))  # other vocab -> new key
    assert len(calls) == 3


def test_user_tokenizer_pad_is_eos_warns_once_and_keeps_eos(eos_pad_tok, caplog):
    with caplog.at_level(logging.WARNING, logger="dsjax.data.tokenizer"):
        t = load_or_train("/nonexistent", 0, None, tokenizer_path=eos_pad_tok)
        load_or_train("/nonexistent", 0, None, tokenizer_path=eos_pad_tok)
    assert t.eos_id == t.pad_id == t.tokenizer.token_to_id("</s>")
    assert len([r for r in caplog.records if "pad token == EOS" in r.message]) == 1
    docs = _docs(12)
    L = PackedLoader(docs, t, batch_size=2, seq_len=32, seed=0, shuffle=False)
    batches = list(L.iter_epoch_once())
    eos_targets = sum(int(((b["targets"] == t.eos_id) & (b["loss_mask"] == 1)).sum())
                      for b in batches)
    assert eos_targets == len(docs)  # every document-ending EOS is trained
    last = batches[-1]
    assert (last["loss_mask"] == 0).any() and (last["targets"][last["loss_mask"] == 0]
                                               == t.eos_id).all()  # padding, masked


def test_user_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_or_train(tmp_path, 0, None, tokenizer_path=tmp_path / "missing.json")
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel()
    t.train_from_iterator(_docs(), trainers.BpeTrainer(vocab_size=280, show_progress=False))
    t.save(str(tmp_path / "noeos.json"))
    with pytest.raises(ValueError, match="no EOS token"):
        load_or_train(tmp_path, 0, None, tokenizer_path=tmp_path / "noeos.json")


# ---------------------------------------------------------------- corpus

def test_stdlib_files():
    files = stdlib_files()
    root = corpus.stdlib_root()
    assert len(files) > 500 and all(p.suffix == ".py" for p in files)
    assert not any("site-packages" in p.parts for p in files)
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel)


def test_split_deterministic_disjoint(tmp_path):
    files = stdlib_files()[:300]
    train, val = split_files(files, 0.1, seed=0)
    assert split_files(list(reversed(files)), 0.1, seed=0) == (train, val)
    assert not set(train) & set(val) and set(train) | set(val) == set(files)
    assert 10 <= len(val) <= 60
    assert split_files(files, 0.1, seed=1) != (train, val)
    # Hashes use the relative path: the same tree elsewhere splits the same way.
    for base in ("a", "b/c"):
        for name in ("x.txt", "y.txt", "sub/z.txt", "w.txt", "v.txt"):
            (tmp_path / base / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / base / name).write_text(name)
    rel = lambda ps, b: [p.relative_to(tmp_path / b) for p in ps]  # noqa: E731
    sa = split_files(sorted((tmp_path / "a").rglob("*.txt")), 0.3, 0)
    sb = split_files(sorted((tmp_path / "b/c").rglob("*.txt")), 0.3, 0)
    assert [rel(x, "a") for x in sa] == [rel(x, "b/c") for x in sb]
    two = sorted((tmp_path / "a").glob("[xy].txt"))
    for frac in (0.0, 0.01, 1.0):
        tr, va = split_files(two, frac, 0)
        assert len(tr) == len(va) == 1


def test_sources(tmp_path):
    (tmp_path / "a.txt").write_text("first doc")
    (tmp_path / "b.py").write_text("x = 1\n")
    (tmp_path / "c.jsonl").write_text(
        json.dumps({"text": "j1", "id": 1}) + "\n\n" + json.dumps({"text": "j2 ✓"}) + "\n")
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    docs = resolve_sources([tmp_path / "a.txt", str(tmp_path / "*.py"), tmp_path / "c.jsonl"])
    assert list(docs) == ["first doc", "x = 1\n", "j1", "j2 ✓"] == list(docs())  # re-iterable
    assert list(resolve_sources(tmp_path / "d.jsonl", field="body")) == ["x"]
    with pytest.raises(ValueError, match=r"d\.jsonl:1: .*no field 'text'"):
        list(resolve_sources(tmp_path / "d.jsonl"))
    (tmp_path / "e.jsonl").write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"e\.jsonl:2: .*'text'"):
        list(resolve_sources(tmp_path / "e.jsonl"))
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        resolve_sources([tmp_path / "a.txt", tmp_path / "nope.txt"])
    with pytest.raises(FileNotFoundError, match=r"glob matches no file: .*\*\.md"):
        resolve_sources(str(tmp_path / "*.md"))


# ---------------------------------------------------------------- loader

def _stream(tok, docs):
    return np.concatenate([np.array(t + [tok.eos_id], np.int32) for t in tok.encode_batch(docs)])


def test_packing_invariants(tok):
    docs, B, T = _docs(), 3, 40
    L = PackedLoader(docs, tok, B, T, seed=0, shuffle=False)
    batches = list(L.iter_epoch_once())
    for b in batches:
        assert {k: (v.shape, v.dtype.name) for k, v in b.items()} == {
            "inputs": ((B, T), "int32"), "targets": ((B, T), "int32"),
            "loss_mask": ((B, T), "float32"), "segment_ids": ((B, T), "int32"),
            "positions": ((B, T), "int32")}
    total_eos = 0
    for j in range(B):  # lane j: documents j, j+B, j+2B, ... in one stream, one row per batch
        lane_docs = docs[j::B]
        stream = _stream(tok, lane_docs)
        inp, tgt, mask, seg, pos = (np.stack([b[k][j] for b in batches]) for k in
                                    ("inputs", "targets", "loss_mask", "segment_ids", "positions"))
        idx = np.arange(len(inp))[:, None] * T + np.arange(T)[None, :]  # stream index of input
        real = seg > 0
        assert np.array_equal(real, idx < len(stream))
        # Rows tile the lane's stream with stride T; targets are inputs shifted by one.
        assert np.array_equal(inp[real], stream[idx[real]])
        assert np.array_equal(tgt[idx + 1 < len(stream)], stream[idx[idx + 1 < len(stream)] + 1])
        assert np.array_equal(tgt[:, :-1], inp[:, 1:])
        # Trained: every transition inside a document, incl. last token -> EOS. Not trained:
        # EOS -> next document's first token, and padding.
        is_eos = real & (inp == tok.eos_id)
        assert np.array_equal(mask == 1, (idx + 1 < len(stream)) & ~is_eos)
        assert mask.sum() == len(stream) - len(lane_docs)
        total_eos += ((tgt == tok.eos_id) & (mask == 1)).sum()
        # Segments: start at 1 each row, +1 after each EOS; positions restart at segment starts.
        for r in range(len(inp)):
            s, p, e = seg[r][real[r]], pos[r][real[r]], is_eos[r][real[r]]
            if not len(s):
                continue  # a padding row
            assert s[0] == 1 and p[0] == 0
            step = np.diff(s)
            assert np.array_equal(step, e[:-1].astype(int))
            assert np.array_equal(p[1:], np.where(step == 1, 0, p[:-1] + 1))
        assert (pos[~real] == 0).all() and (inp[~real] == tok.pad_id).all()
    assert total_eos == len(docs)


def test_batches_mix_documents(tok):
    """Every training batch draws its rows from batch_size different documents."""
    docs = [f"doc{i} " + "x = 1\n" * 200 for i in range(12)]
    L = PackedLoader(docs, tok, 4, 16, seed=0)
    b = next(L)
    heads = {tok.decode(b["inputs"][r][:8].tolist()).split()[0] for r in range(4)}
    assert len(heads) == 4 and all(h.startswith("doc") for h in heads), heads


def test_shuffle_epochs(tok):
    docs = _docs(10)
    L = PackedLoader(docs, tok, 1, 16, seed=5)
    first = next(L)["inputs"][0]
    order = np.random.default_rng(5).permutation(len(docs))
    assert np.array_equal(first, _stream(tok, [docs[i] for i in order])[:16])
    ep1 = _stream(tok, [docs[i] for i in np.random.default_rng(6).permutation(len(docs))])
    ep0 = _stream(tok, [docs[i] for i in order])
    n0 = len(ep0) // 16 * 16
    L.restore({**L.state(), "cursors": [[0, 0, 0]]})
    toks = np.concatenate([next(L)["inputs"][0] for _ in range(n0 // 16 + 3)])
    assert np.array_equal(toks, np.concatenate([ep0, ep1])[:len(toks)])
    b = next(PackedLoader(docs, tok, 1, 16, seed=5, shuffle=False))
    assert np.array_equal(b["inputs"][0], _stream(tok, docs)[:16])


@pytest.mark.parametrize("k", [0, 1, 3, 7, 12])
def test_resume_exact(tok, k):
    docs = _docs(5)  # ~5 batches per epoch: k = 7 and 12 resume past epoch boundaries
    mk = lambda: PackedLoader(docs, tok, 2, 24, seed=3, chunk_docs=4)  # noqa: E731
    ref = mk()
    want = [next(ref) for _ in range(k + 8)]
    a = mk()
    for _ in range(k):
        next(a)
    state = json.loads(json.dumps(a.state()))
    b = mk()
    b.restore(state)
    for got, exp in zip([next(b) for _ in range(8)], want[k:]):
        for key in exp:
            assert np.array_equal(got[key], exp[key]), (k, key)
    if k >= 7:
        assert max(c[0] for c in state["cursors"]) >= 1


def test_restore_mismatch(tok):
    a = PackedLoader(_docs(9), tok, 2, 24, seed=3)
    with pytest.raises(ValueError, match="num_docs"):
        PackedLoader(_docs(8), tok, 2, 24, seed=3).restore(a.state())
    with pytest.raises(ValueError, match="seed"):
        PackedLoader(_docs(9), tok, 2, 24, seed=4).restore(a.state())
    with pytest.raises(ValueError, match="does not fit"):
        PackedLoader(_docs(9), tok, 2, 24, seed=3).restore(
            {**a.state(), "cursors": [[0, 0, 10**6], [0, 0, 0]]})
    with pytest.raises(ValueError, match="lanes"):
        PackedLoader(_docs(9), tok, 3, 24, seed=3).restore(a.state())


@pytest.mark.parametrize("P", [2, 4])
def test_process_sharding(tok, P):
    docs, B, T = _docs(), 4, 16
    glob_train = PackedLoader(docs, tok, B, T, seed=1)
    parts = [PackedLoader(docs, tok, B, T, seed=1, process_index=i, process_count=P)
             for i in range(P)]
    for _ in range(5):
        g = next(glob_train)
        ps = [next(p) for p in parts]
        for key in g:
            assert np.array_equal(np.concatenate([p[key] for p in ps]), g[key])
    glob_val = list(PackedLoader(docs, tok, B, T, 1).iter_epoch_once())
    part_val = [list(PackedLoader(docs, tok, B, T, 1, process_index=i, process_count=P)
                     .iter_epoch_once()) for i in range(P)]
    assert all(len(pv) == len(glob_val) for pv in part_val)
    for j, g in enumerate(glob_val):
        for key in g:
            assert np.array_equal(np.concatenate([pv[j][key] for pv in part_val]), g[key])
    with pytest.raises(ValueError, match="divisible"):
        PackedLoader(docs, tok, 3, T, 1, process_count=2)


def test_validation_pass(tok):
    docs = _docs()
    L = PackedLoader(docs, tok, 2, 32, seed=0)
    next(L)
    before = L.state()
    full = list(L.iter_epoch_once())
    assert L.state() == before  # validation does not move the training cursor
    # padding only once a lane has run out: no real token after padding in any row's lane
    real = np.stack([b["segment_ids"] > 0 for b in full])  # [batches, B, T]
    lane_real = real.transpose(1, 0, 2).reshape(2, -1)
    for lane in lane_real:
        first_pad = np.argmin(lane) if not lane.all() else len(lane)
        assert not lane[first_pad:].any()
    assert len(list(L.iter_epoch_once(max_batches=3))) == 3
    assert np.array_equal(list(L.iter_epoch_once())[-1]["inputs"], full[-1]["inputs"])
    assert full[-1]["loss_mask"].sum() < full[-1]["loss_mask"].size


def test_loader_throughput(tok):
    """Packing must not bottleneck a tiny CPU model (tens of thousands of tokens/s)."""
    import time
    docs = [corpus.read_text(p) for p in stdlib_files()[:60]]
    L = PackedLoader(docs, tok, 8, 256, seed=0)
    t0, n = time.perf_counter(), 0
    for _ in range(50):
        n += next(L)["inputs"].size
    assert n / (time.perf_counter() - t0) > 50_000


def test_fewer_documents_than_rows_are_split(tok):
    """One big file and batch 8: the document is split at line boundaries, one piece per lane."""
    big = "".join(f"line {i} = {i * i}\n" for i in range(400))
    L = PackedLoader([big], tok, 8, 16, seed=0)
    assert len(L.docs) == 8 and "".join(L.docs) == big
    assert all(d.endswith("\n") for d in L.docs)
    b = next(L)
    firsts = {tok.decode(b["inputs"][r][:8].tolist()) for r in range(8)}
    assert len(firsts) == 8 and all(f.startswith("line ") for f in firsts), firsts
    assert len(list(PackedLoader(["ab"], tok, 4, 8, seed=0).iter_epoch_once())) >= 1


# ---------------------------------------------------------------- Parquet, encodings, binaries

def _random_docs(n, seed):
    rng = np.random.default_rng(seed)
    words = ["def", "x", "héllo", "日本", "return", "🚀", "\n", "\t", "class", "0x1f", "é"]
    return [" ".join(rng.choice(words, size=int(rng.integers(3, 40)))) for _ in range(n)]


def _parquet(path, docs, row_group_size, column="text", **extra):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": list(range(len(docs))), column: docs, **extra}), path,
                   row_group_size=row_group_size)
    return path


def test_parquet_documents_stream_by_row_group_and_resume_bitwise(tok, tmp_path, monkeypatch):
    import pyarrow.parquet as pq
    from dsjax.data import parquet
    docs_a, docs_b = _random_docs(23, 1), _random_docs(17, 2)
    a = _parquet(tmp_path / "a.parquet", docs_a, row_group_size=5)
    (tmp_path / "sub").mkdir()
    b = _parquet(tmp_path / "sub" / "b.parquet", docs_b, row_group_size=4, column="content",
                 text=[f"other {i}" for i in range(17)])
    assert pq.ParquetFile(a).metadata.num_row_groups == 5
    # read in record batches of row groups, never a whole table
    monkeypatch.setattr(parquet, "_BATCH_ROWS", 3)
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: pytest.fail("whole-table read"))
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("whole-file read"))
    assert list(Documents([a])) == docs_a
    assert list(resolve_sources(tmp_path, field="text")) == docs_a + [f"other {i}" for i in range(17)]
    assert list(Documents([b], field="content")) == docs_b
    # the same documents from JSONL give the same batches
    jl = tmp_path / "a.jsonl"
    jl.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs_a))
    mk = lambda files, field="text": PackedLoader(Documents(files, field), tok, 3, 20, seed=7,  # noqa: E731
                                                  chunk_docs=4)
    ref_j, ref_p = mk([jl]), mk([a])
    for _ in range(4):
        bj, bp = next(ref_j), next(ref_p)
        for key in bj:
            assert np.array_equal(bj[key], bp[key]), key
    # resume: k batches, state through JSON, a fresh loader continues bitwise
    for k in (0, 5, 13):  # 13 crosses an epoch boundary
        ref = mk([a])
        want = [next(ref) for _ in range(k + 6)]
        run = mk([a])
        for _ in range(k):
            next(run)
        state = json.loads(json.dumps(run.state()))
        fresh = mk([a])
        fresh.restore(state)
        for exp in want[k:]:
            got = next(fresh)
            for key in exp:
                assert np.array_equal(got[key], exp[key]), (k, key)


def test_parquet_bad_inputs_name_file_column_and_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    good = _parquet(tmp_path / "good.parquet", _random_docs(12, 3), row_group_size=4)
    with pytest.raises(ValueError) as e:
        Documents([good], field="body")
    msg = str(e.value)
    assert msg.startswith(f"{good}: no column 'body' (data.text_field)") and "id, text" in msg
    with pytest.raises(ValueError, match=r"column 'id' \(data.text_field\) holds int64, not strings"):
        Documents([good], field="id")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(np.random.default_rng(0).bytes(3000))
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[:-40])
    for bad in (junk, cut):
        with pytest.raises(ValueError, match=f"^{bad}: not a readable Parquet file") as e:
            Documents([good, bad])
        assert "\n" not in str(e.value)
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), nulls, row_group_size=2)
    with pytest.raises(ValueError, match=f"^{nulls}: row 2: column 'text' \\(data.text_field\\) is null"):
        list(Documents([nulls]))


def _binary(path, seed):
    data = bytearray(np.random.default_rng(seed).bytes(5000))
    data[100] = 0
    path.write_bytes(bytes(data))
    return path


def test_binary_and_non_utf8_files_in_a_folder_are_skipped_with_one_warning(tmp_path, caplog):
    d = tmp_path / "corpus"
    (d / "deep").mkdir(parents=True)
    (d / "a.txt").write_text("first ✓\n")
    (d / "deep" / "b.md").write_text("second\n")
    _binary(d / "model.bin", 1)
    _binary(d / "deep" / "w.bin", 2)
    (d / "latin1.txt").write_bytes("ascii\nline two\ncaf\xe9\n".encode("latin-1"))
    with caplog.at_level(logging.WARNING, logger="dsjax.data.corpus"):
        files = corpus.expand_sources([d, str(d / "*.txt")], "data.train")
    assert files == [d / "a.txt", d / "deep" / "b.md"]
    warns = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warns) == 1 and "data.train: skipped 3 binary or non-UTF-8 files" in warns[0]
    assert str(d / "deep" / "w.bin") in warns[0]  # the first found
    assert list(Documents(files)) == ["first ✓\n", "second\n"]
    # a folder (or glob) of nothing but binaries: one line naming it and the field
    only = tmp_path / "only"
    only.mkdir()
    _binary(only / "x.bin", 3)
    with pytest.raises(ValueError, match=f"^data.validation: {only} holds no usable file: all 1 "):
        corpus.expand_sources(only, "data.validation")
    with pytest.raises(ValueError, match=r"^data.train: .*\*.bin holds no usable file"):
        corpus.expand_sources(str(only / "*.bin"))
    # a file named on its own is an error naming it (and the line of the first bad byte)
    with pytest.raises(ValueError, match=f"^{d / 'model.bin'}: not UTF-8 text \\(NUL byte at offset 100\\)"):
        corpus.expand_sources(d / "model.bin")
    with pytest.raises(ValueError, match=f"^{d / 'latin1.txt'}: not UTF-8 text \\(byte 0xe9 at line 3"):
        corpus.expand_sources([d / "a.txt", d / "latin1.txt"])


def test_not_text_reads_in_chunks(tmp_path, monkeypatch):
    # multi-byte characters across chunk boundaries are fine; the bad byte's line is exact
    monkeypatch.setattr(corpus, "_READ_CHUNK", 7)
    f = tmp_path / "t.txt"
    text = "ab\n日本語のテキスト\n🚀🐍 é\n" * 5
    f.write_text(text)
    assert corpus.not_text(f) is None
    f.write_bytes(text.encode() + "x\ny\xff\n".encode("latin-1"))
    assert corpus.not_text(f) == "byte 0xff at line 17 is not UTF-8"
    f.write_bytes(text.encode() + "日".encode()[:2])
    assert "ends inside a UTF-8 character" in corpus.not_text(f)


def test_non_utf8_jsonl_line_names_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"text": "fine"}\n\n' + '{"text": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=f"^{f}:3: not UTF-8 text \\(byte 0xe9 at column 14\\)"):
        list(resolve_sources(f))


def _cli(tmp_path, monkeypatch, capsys, sets):
    """`python -m dsjax.train` (the entry point under run_main, in this process)."""
    import sys
    from pathlib import Path

    from dsjax.cli import run_main
    from dsjax.train.__main__ import main as train_main
    root = Path(__file__).resolve().parents[2]
    argv = ["dsjax.train", "--config", str(root / "configs" / "tiny.yaml"),
            "--set", f"train.run_dir={tmp_path / 'run'}", "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    for s in sets:
        argv += ["--set", s]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as ex:
        run_main("dsjax.train", train_main)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert ex.value.code == 2 and len(lines) == 1, lines
    assert not (tmp_path / "run").exists()
    return lines[0]


@pytest.mark.parametrize("case", ["missing column", "corrupt parquet", "latin-1 jsonl",
                                  "binary folder", "binary file"])
def test_bad_data_through_the_cli(tmp_path, monkeypatch, capsys, case):
    src = tmp_path / "src"
    src.mkdir()
    if case == "missing column":
        path, sets, needle = _parquet(src / "d.parquet", _random_docs(8, 4), 4, column="body"), [], \
            "no column 'text' (data.text_field)"
    elif case == "corrupt parquet":
        path, sets, needle = src / "d.parquet", [], "not a readable Parquet file"
        path.write_bytes(b"PAR1" + bytes(200))
    elif case == "latin-1 jsonl":
        path, sets, needle = src / "d.jsonl", [], ":2: not UTF-8 text"
        path.write_bytes(b'{"text": "a"}\n' + '{"text": "\xe9"}\n'.encode("latin-1"))
    elif case == "binary folder":
        path, sets, needle = src, [], f"data.train: {src} holds no usable file"
        _binary(src / "a.bin", 5)
    else:
        path, sets, needle = _binary(src / "train.bin", 6), [], "not UTF-8 text (NUL byte at offset 100)"
    line = _cli(tmp_path, monkeypatch, capsys, [f"data.train=[{path}]", *sets])
    assert line.startswith("dsjax.train: error: ") and needle in line, line
    assert str(path) in line
