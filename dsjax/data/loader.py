"""Packed, deterministic, resumable batches of token ids.

Lanes. Each of the ``batch_size`` global rows of a batch is fed by its own lane. In epoch e the
documents are put in order (``numpy.random.default_rng(seed + e).permutation``, or file order
without shuffling) and dealt round-robin: lane j gets ``order[j::batch_size]``. A lane
tokenises its documents, appends EOS to each, and concatenates them into one token stream that
runs on across its epoch boundaries. Lane j's row in batch i is ``stream_j[i*T : i*T + T + 1]``
(T = ``seq_len``): consecutive rows of a lane share one token, so every token-to-next-token
transition is a target exactly once, and a long document continues in the same row of the next
batch. Every batch therefore mixes ``batch_size`` different documents (packing one stream row
after row would fill a whole batch from one or two long files: highly correlated gradients).

Per batch (B = rows of this process, T = ``seq_len``; all numpy):
  inputs      [B, T] int32    row[:-1]
  targets     [B, T] int32    row[1:]
  loss_mask   [B, T] float32  1 where the target is a real token of the *same* document as the
                              input, which includes the EOS ending each document (so EOS is
                              trained even when pad == EOS). 0 where input is a document's EOS
                              and the target is the next document's first token: that crosses
                              a document boundary and, with attention masked by segment, would
                              be predicted from an unrelated (randomly ordered) document, i.e.
                              noise. 0 on padding.
  segment_ids [B, T] int32    1, 2, ... per document within the row, restarting each row; the
                              EOS belongs to the document it ends, the token after it starts the
                              next segment; 0 = padding. Attention: query i sees key j iff
                              j <= i and segment_ids equal.
  positions   [B, T] int32    position within the segment in this row, 0 at each segment start.
                              A document continued from the previous row restarts at 0: RoPE
                              attention only sees differences of positions inside a segment, so
                              this equals the true in-document offset and keeps positions < T.

A corpus with fewer documents than ``batch_size`` (one big text file, say) is first split into
pieces at line boundaries (``split_documents``), so that every lane has text of its own.

Padding (pad_id, mask 0, segment 0, position 0) appears only in a finite pass
(``iter_epoch_once``): once a lane has run out of documents its rows are padding; the pass ends
when every lane has.

Resume. ``state()`` holds each lane's cursor ``[epoch, doc, offset]`` (document index in the lane's
share of the epoch order and token offset inside it, EOS included) plus checks; ``restore``
re-tokenises those documents and continues, so a restored loader yields exactly the batches the
original would. Resuming needs the same batch_size (the number of lanes).

Hosts. With ``process_count`` P every process advances all lanes (cheap: token counts) and
returns rows ``[i*B/P, (i+1)*B/P)`` of each global batch of ``batch_size`` rows.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np

_STATE_VERSION = 2


class _Stream:
    """Cursor over the concatenated token stream of ``docs`` (with EOS after each)."""

    def __init__(self, docs: list[str], tok, seed: int, shuffle: bool, finite: bool,
                 chunk_docs: int, lane: int = 0, lanes: int = 1):
        self.docs, self.tok, self.seed = docs, tok, seed
        self.lane, self.lanes = lane, lanes
        self.shuffle, self.finite, self.chunk_docs = shuffle, finite, chunk_docs
        self.epoch, self.doc, self.offset = 0, 0, 0
        self._orders: dict[int, np.ndarray] = {}
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            n = len(self.docs)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            full = (np.random.default_rng(self.seed + epoch).permutation(n)
                    if self.shuffle else np.arange(n))
            self._orders[epoch] = full[self.lane::self.lanes]
        return self._orders[epoch]

    def tokens(self, epoch: int, doc: int) -> np.ndarray:
        """int32 ids of document ``doc`` of ``epoch``'s order, EOS appended; tokenised in chunks."""
        key = (epoch, doc)
        if key not in self._cache:
            self._cache = {k: v for k, v in self._cache.items() if k >= (self.epoch, self.doc)}
            order = self.order(epoch)
            idx = range(doc, min(doc + self.chunk_docs, len(order)))
            ids = self.tok.encode_batch([self.docs[order[i]] for i in idx])
            for i, t in zip(idx, ids):
                self._cache[(epoch, i)] = np.asarray(t + [self.tok.eos_id], np.int32)
        return self._cache[key]

    def peek(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``n`` tokens from the cursor and a per-token document serial (0, 1, ...)."""
        toks, serial, have = [], [], 0
        epoch, doc, off, s = self.epoch, self.doc, self.offset, 0
        while have < n:
            if doc == len(self.order(epoch)):
                if self.finite:
                    break
                epoch, doc = epoch + 1, 0
            t = self.tokens(epoch, doc)[off:n - have + off]
            toks.append(t)
            serial.append(np.full(len(t), s, np.int32))
            have, s, doc, off = have + len(t), s + 1, doc + 1, 0
        if not toks:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        return np.concatenate(toks), np.concatenate(serial)

    def advance(self, n: int) -> None:
        while n > 0:
            if self.doc == len(self.order(self.epoch)):
                if self.finite:
                    return
                self.epoch, self.doc = self.epoch + 1, 0
            left = len(self.tokens(self.epoch, self.doc)) - self.offset
            if n < left:
                self.offset += n
                return
            n -= left
            self.doc, self.offset = self.doc + 1, 0
        if self.doc == len(self.order(self.epoch)) and not self.finite:
            self.epoch, self.doc = self.epoch + 1, 0


def pack_rows(tokens: np.ndarray, serial: np.ndarray, rows: int, seq_len: int,
              pad_id: int) -> dict[str, np.ndarray]:
    """Cut ``rows`` rows of ``seq_len + 1`` tokens (stride ``seq_len``) from a token run.

    Args:
      tokens: [N] int32 ids, N <= rows*seq_len + 1; missing tokens become padding.
      serial: [N] int32, equal for tokens of the same document (EOS included), increasing.
    Returns the batch dict described in the module docstring, leading dim ``rows``.
    """
    T = seq_len
    n_full = rows * T + 1
    tok = np.full(n_full, pad_id, np.int32)
    ser = np.full(n_full, -1, np.int32)
    tok[:len(tokens)], ser[:len(serial)] = tokens, serial
    idx = np.arange(rows)[:, None] * T + np.arange(T + 1)[None, :]
    tok, ser = tok[idx], ser[idx]  # [rows, T+1]
    valid = ser >= 0
    start = np.ones_like(valid)
    start[:, 1:] = ser[:, 1:] != ser[:, :-1]
    seg = np.where(valid, np.cumsum(start, axis=1), 0)
    col = np.arange(T + 1)[None, :]
    pos = np.where(valid, col - np.maximum.accumulate(np.where(start, col, 0), axis=1), 0)
    mask = valid[:, 1:] & (ser[:, 1:] == ser[:, :-1])
    return {
        "inputs": tok[:, :-1].copy(), "targets": tok[:, 1:].copy(),
        "loss_mask": mask.astype(np.float32),
        "segment_ids": seg[:, :-1].astype(np.int32), "positions": pos[:, :-1].astype(np.int32),
    }


def split_documents(docs: list[str], parts: int) -> list[str]:
    """Split documents into at least ``parts`` pieces, each document into about equal pieces at
    line boundaries (at character boundaries for documents of too few lines), in order.

    Used when a corpus has fewer documents than batch rows (e.g. one big text file): every lane
    then still gets its own text. Each piece becomes a document of its own (EOS after it).
    """
    per_doc = -(-parts // len(docs))
    out = []
    for d in docs:
        lines = d.splitlines(keepends=True)
        units = lines if len(lines) >= per_doc else list(d)
        n = min(per_doc, len(units))
        size = -(-len(units) // n)
        out.extend("".join(units[i:i + size]) for i in range(0, len(units), size))
    return [p for p in out if p]


def check_state(state: dict, mine: dict, keys) -> None:
    """Raise ValueError naming the first of ``keys`` where a checkpoint's loader ``state``
    differs from this loader's (``mine``); for ``num_docs`` it says what changes it."""
    for k in keys:
        if state.get(k) != mine[k]:
            why = (" (the training files, or the validation split drawn from them, are not the "
                   "checkpoint's)" if k == "num_docs" else "")
            raise ValueError(f"loader state mismatch on {k!r}: checkpoint has {state.get(k)!r}, "
                             f"this loader {mine[k]!r}{why}")


class PackedLoader:
    """Infinite, shuffled, resumable packed batches; plus a finite validation pass.

    Args:
      docs_factory: callable returning an iterable of document strings, or a re-iterable
        (e.g. ``corpus.Documents``). Read once, at construction, into memory (empty documents
        dropped); tokenisation is lazy, ``chunk_docs`` documents at a time.
      tok: ``tokenizer.Tok`` (``encode_batch``, ``eos_id``, ``pad_id``).
      batch_size: global rows per batch (over all processes); seq_len: T tokens per row.
      seed: shuffle seed; epoch e uses ``default_rng(seed + e)``.
      shuffle: False = file order every epoch.
      process_index, process_count: this host's slice of each global batch.
    Iterating yields dicts of numpy arrays (see module docstring), leading dim
    ``batch_size // process_count``.
    """

    def __init__(self, docs_factory: Callable[[], Iterable[str]] | Iterable[str], tok,
                 batch_size: int, seq_len: int, seed: int = 0, shuffle: bool = True,
                 process_index: int = 0, process_count: int = 1, chunk_docs: int = 64):
        if batch_size % process_count:
            raise ValueError(f"batch_size {batch_size} not divisible by process_count "
                             f"{process_count}")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in [0, {process_count})")
        docs = docs_factory() if callable(docs_factory) else docs_factory
        self.docs = [d for d in docs if d]
        if not self.docs:
            raise ValueError("PackedLoader: no non-empty documents")
        if len(self.docs) < batch_size:
            self.docs = split_documents(self.docs, batch_size)
        self.tok, self.batch_size, self.seq_len = tok, batch_size, seq_len
        self.seed, self.shuffle, self.chunk_docs = seed, shuffle, chunk_docs
        self.process_index, self.process_count = process_index, process_count
        self._streams = self._lanes(shuffle, finite=False)

    def _lanes(self, shuffle: bool, finite: bool) -> list[_Stream]:
        if not finite and len(self.docs) < self.batch_size:
            # only an endless pass needs every lane fed; a finite pass pads empty lanes
            return []
        return [_Stream(self.docs, self.tok, self.seed, shuffle, finite, self.chunk_docs, j,
                        self.batch_size) for j in range(self.batch_size)]

    def _batch(self, streams: list[_Stream]) -> dict[str, np.ndarray] | None:
        T = self.seq_len
        rows = self.batch_size // self.process_count
        lo = self.process_index * rows
        out, live = [], False
        for j, stream in enumerate(streams):
            if lo <= j < lo + rows:
                tokens, serial = stream.peek(T + 1)
                live |= len(tokens) >= 2
                out.append(pack_rows(tokens, serial, 1, T, self.tok.pad_id))
            else:
                live |= len(stream.peek(2)[0]) >= 2
            stream.advance(T)
        if not live:
            return None
        return {k: np.concatenate([o[k] for o in out]) for k in out[0]}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if not self._streams:
            raise ValueError(f"PackedLoader: the corpus has too little text ({len(self.docs)} "
                             f"pieces) to feed {self.batch_size} batch rows; use a smaller "
                             f"data.batch_size or more text")
        return self._batch(self._streams)

    def iter_epoch_once(self, max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """One unshuffled pass over the documents (validation), from the start, independent of
        (and not moving) the training cursor. Exhausted lanes give padding rows; at most
        ``max_batches`` batches."""
        streams = self._lanes(shuffle=False, finite=True)
        n = 0
        while max_batches is None or n < max_batches:
            batch = self._batch(streams)
            if batch is None:
                return
            n += 1
            yield batch

    def num_tokens(self) -> int:
        """Tokens in one epoch (documents + their EOS); tokenises the whole corpus once."""
        return sum(len(t) + 1 for i in range(0, len(self.docs), 1024)
                   for t in self.tok.encode_batch(self.docs[i:i + 1024]))

    def state(self) -> dict:
        """JSON-serialisable cursors: where each lane's next row starts in its token stream."""
        return {"version": _STATE_VERSION, "seed": self.seed, "shuffle": self.shuffle,
                "num_docs": len(self.docs), "lanes": self.batch_size,
                "cursors": [[s.epoch, s.doc, s.offset] for s in self._streams]}

    def restore(self, state: dict) -> None:
        """Continue from ``state()`` of a loader over the same documents, seed, shuffle and
        batch_size. Raises ValueError naming the first mismatch."""
        check_state(state, self.state(), ("version", "seed", "shuffle", "num_docs", "lanes"))
        streams = self._lanes(self.shuffle, finite=False)
        if len(state["cursors"]) != len(streams):
            raise ValueError("loader state mismatch on 'cursors': wrong number of lanes")
        for s, (epoch, doc, offset) in zip(streams, state["cursors"]):
            s.epoch, s.doc, s.offset = int(epoch), int(doc), int(offset)
            share = len(s.order(s.epoch))
            if not 0 <= s.doc < share:
                raise ValueError(f"loader state: lane {s.lane} document index {s.doc} out of range")
            n = len(s.tokens(s.epoch, s.doc))
            if not 0 <= s.offset < n:
                raise ValueError(f"loader state: lane {s.lane} offset {s.offset} does not fit this "
                                 f"corpus/tokenizer (document has {n} tokens)")
        self._streams = streams
