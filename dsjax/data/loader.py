"""Packed, deterministic, resumable batches of token ids.

Stream. Each document is tokenised and followed by EOS; documents are concatenated in epoch
order (shuffled per epoch with ``numpy.random.default_rng(seed + epoch)``, or file order) into
one token stream that runs on across epoch boundaries. Row ``r`` of the stream is
``stream[r*T : r*T + T + 1]`` (T = ``seq_len``): consecutive rows share one token, so every
token-to-next-token transition is a target exactly once. A document may continue into the
next row (standard packing). A batch is ``batch_size`` consecutive rows.

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

Padding (pad_id, mask 0, segment 0, position 0) appears only at the end of a finite pass
(``iter_epoch_once``): the last row is completed and the last batch filled with padding rows.

Resume. ``state()`` is the stream cursor ``{epoch, doc, offset}`` (document index in the epoch
order and token offset inside it, EOS included) plus checks; ``restore`` re-tokenises that one
document and continues, so a restored loader yields exactly the batches the original would.
The state is in token units, independent of batch size and of process count.

Hosts. With ``process_count`` P every process walks the same global stream and returns rows
``[i*B/P, (i+1)*B/P)`` of each global batch of ``batch_size`` rows.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np

_STATE_VERSION = 1


class _Stream:
    """Cursor over the concatenated token stream of ``docs`` (with EOS after each)."""

    def __init__(self, docs: list[str], tok, seed: int, shuffle: bool, finite: bool,
                 chunk_docs: int):
        self.docs, self.tok, self.seed = docs, tok, seed
        self.shuffle, self.finite, self.chunk_docs = shuffle, finite, chunk_docs
        self.epoch, self.doc, self.offset = 0, 0, 0
        self._orders: dict[int, np.ndarray] = {}
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            n = len(self.docs)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = (np.random.default_rng(self.seed + epoch).permutation(n)
                                   if self.shuffle else np.arange(n))
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
            if doc == len(self.docs):
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
            if self.doc == len(self.docs):
                if self.finite:
                    return
                self.epoch, self.doc = self.epoch + 1, 0
            left = len(self.tokens(self.epoch, self.doc)) - self.offset
            if n < left:
                self.offset += n
                return
            n -= left
            self.doc, self.offset = self.doc + 1, 0
        if self.doc == len(self.docs) and not self.finite:
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
        self.tok, self.batch_size, self.seq_len = tok, batch_size, seq_len
        self.seed, self.shuffle, self.chunk_docs = seed, shuffle, chunk_docs
        self.process_index, self.process_count = process_index, process_count
        self._stream = _Stream(self.docs, tok, seed, shuffle, False, chunk_docs)

    def _batch(self, stream: _Stream) -> dict[str, np.ndarray] | None:
        B, T = self.batch_size, self.seq_len
        tokens, serial = stream.peek(B * T + 1)
        if len(tokens) < 2:
            return None
        stream.advance(B * T)
        rows = B // self.process_count
        lo = self.process_index * rows
        part = slice(lo * T, (lo + rows) * T + 1)
        return pack_rows(tokens[part], serial[part], rows, T, self.tok.pad_id)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return self._batch(self._stream)

    def iter_epoch_once(self, max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """One unshuffled pass over the documents (validation), from the start, independent of
        (and not moving) the training cursor. The last batch is padded; at most ``max_batches``."""
        stream = _Stream(self.docs, self.tok, self.seed, False, True, self.chunk_docs)
        n = 0
        while max_batches is None or n < max_batches:
            batch = self._batch(stream)
            if batch is None:
                return
            n += 1
            yield batch

    def num_tokens(self) -> int:
        """Tokens in one epoch (documents + their EOS); tokenises the whole corpus once."""
        return sum(len(t) + 1 for i in range(0, len(self.docs), 1024)
                   for t in self.tok.encode_batch(self.docs[i:i + 1024]))

    def state(self) -> dict:
        """JSON-serialisable cursor: where the next batch starts in the token stream."""
        s = self._stream
        return {"version": _STATE_VERSION, "epoch": s.epoch, "doc": s.doc, "offset": s.offset,
                "seed": self.seed, "shuffle": self.shuffle, "num_docs": len(self.docs)}

    def restore(self, state: dict) -> None:
        """Continue from ``state()`` of a loader over the same documents, seed and shuffle."""
        mine = self.state()
        for k in ("version", "seed", "shuffle", "num_docs"):
            if state.get(k) != mine[k]:
                raise ValueError(f"loader state mismatch on {k!r}: checkpoint has "
                                 f"{state.get(k)!r}, this loader {mine[k]!r}")
        self._stream = _Stream(self.docs, self.tok, self.seed, self.shuffle, False,
                               self.chunk_docs)
        s = self._stream
        s.epoch, s.doc, s.offset = int(state["epoch"]), int(state["doc"]), int(state["offset"])
        if not (0 <= s.doc < len(self.docs) and 0 <= s.offset < len(s.tokens(s.epoch, s.doc))):
            raise ValueError(f"loader state {state} does not fit this corpus/tokenizer "
                             f"(document {s.doc} has {len(s.tokens(s.epoch, s.doc))} tokens)"
                             if 0 <= s.doc < len(self.docs) else
                             f"loader state {state}: document index out of range")
