"""Chat data for supervised fine-tuning: conversations -> chat template -> tokens with an
assistant-only loss mask -> packed rows.

Input. JSONL, one conversation per line, or Parquet, one conversation per row, either
  {"messages": [{"role": "system"|"user"|"assistant", "content": str, ...}, ...]}
or {"prompt": str, "completion": str} (one user turn, one assistant turn; ``prompt`` and
``completion`` may also be lists of messages, which are concatenated); in Parquet these are
columns (``messages`` a list of structs). Keys other than these are ignored; extra message keys
(e.g. ``reasoning_content``) are passed on to the template. A line that is not UTF-8 or not
valid JSON, a message without a role or string content, an unknown role, and a conversation
without an assistant message raise ``ValueError("FILE:LINE: ...")`` (``"FILE:row N: ..."`` for
Parquet, rows numbered from 0); a Parquet file without those columns, before any is read.
Sources that leave no conversation to train on (empty files, every conversation too long)
raise ValueError naming the config field, each file and why.

Rendering. The checkpoint's ``chat_template`` (``tokenizer_config.json`` or a ``.jinja`` file) is
rendered the way transformers' ``apply_chat_template`` renders it: a sandboxed jinja2 environment
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter
that does not escape HTML (``json.dumps``, ``ensure_ascii=False``), the globals
``raise_exception`` and ``strftime_now``, and as variables ``messages``, ``tools=None``,
``documents=None``, ``add_generation_prompt`` and the special-token strings of the tokenizer
config (``bos_token``, ``eos_token``, ...). The text is tokenised whole, special tokens
recognised and none added (``add_special_tokens=False``), as transformers does with
``tokenize=True``. Like transformers by default, the text of an added token inside a message
(a literal ``<｜end▁of▁sentence｜>`` in an answer, say) becomes that token; such conversations
are counted (``ChatStats.control_text``) and logged.

Which tokens are trained. Character spans of the rendered text that the assistant produces:
  * a template with ``{% generation %}...{% endgeneration %}`` blocks: those blocks;
  * otherwise (DeepSeek V2/V3 templates have no such blocks), for assistant message i, the text
    that rendering ``messages[:i+1]`` adds after its longest common prefix with
    ``messages[:i]`` rendered with ``add_generation_prompt=True``. This is the answer and
    everything the template closes it with, so the EOS that ends each answer
    (``<｜end▁of▁sentence｜>`` in V3, ``eos_token`` in V2) is trained; the generation prompt
    (``<｜Assistant｜>``, ``Assistant:``) is not. The template must render earlier turns the
    same whatever follows them (DeepSeek's do); otherwise a one-line error names the line.
A token is trained if its character offsets overlap a span (the rule transformers uses for
``return_assistant_tokens_mask``). System, user and template tokens are masked.

Packing and the batch contract (same keys, shapes and meaning as ``loader.py``). A row holds
T + 1 tokens (T = ``seq_len``): whole conversations one after another, padding after them.
  inputs, targets [B, T] int32    row[:-1], row[1:]
  loss_mask       [B, T] float32  1 iff the target is a trained (assistant) token of the same
                                  conversation as the input; 0 on prompts, across conversation
                                  boundaries and on padding
  segment_ids     [B, T] int32    1, 2, ... per conversation in the row, 0 = padding
  positions       [B, T] int32    position within the conversation, 0 at its first token
Conversations are packed first-fit into the batch's rows in epoch order (shuffled per epoch with
``default_rng(seed + epoch)``); the batch closes at the first conversation that fits no row, which
then opens the next batch. Every conversation is seen once per epoch, never split.

Truncation (``truncation``), for a conversation longer than T + 1 tokens; never silent, every
case is counted in ``ChatStats`` and logged:
  * ``drop``: the conversation is left out.
  * ``drop_turns``: the oldest exchanges (from a user message up to the next user message) are
    removed, leading system messages kept, until it fits; every kept answer stays whole with its
    EOS. Left out if even the last exchange does not fit.
  * ``cut_tail``: the first T + 1 tokens are kept; the answer that crosses the cut loses its end
    (and EOS), answers after the cut are lost. Left out if no trained token is left.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import jinja2
import numpy as np
from tokenizers import Tokenizer

from dsjax.data.chat_template import ChatTemplate, load_chat_template
from dsjax.data import parquet
from dsjax.data.corpus import decode_line, expand_sources
from dsjax.data.loader import check_state, pack_rows
from dsjax.data.tokenizer import read_tokenizer, warn_pad_is_eos

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
TRUNCATION = ("drop", "drop_turns", "cut_tail")
_STATE_VERSION = 1


# ----------------------------------------------------------------------------------------------
# Reading conversations
# ----------------------------------------------------------------------------------------------


def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: messages[{j}] is {type(m).__name__}, not an object")
        if m.get("role") is None:  # absent, or null (a Parquet struct without it)
            raise ValueError(f"{where}: messages[{j}] has no 'role'")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: messages[{j}] role {m['role']!r} is not one of "
                             f"{', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            got = "no 'content'" if m.get("content") is None else \
                f"'content' of type {type(m['content']).__name__}"
            raise ValueError(f"{where}: messages[{j}] ({m['role']}) has {got}, not a string")
        out.append({k: v for k, v in m.items() if v is not None})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"{where}: conversation has no assistant message (nothing to train)")
    return out


def parse_conversation(obj, where: str) -> list[dict]:
    """One JSONL record -> checked list of messages. ``where`` ("file:line") prefixes errors."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        return _check_messages(obj["messages"], where)
    if "prompt" in obj and "completion" in obj:
        p, c = obj["prompt"], obj["completion"]
        if isinstance(p, str) and isinstance(c, str):
            return _check_messages([{"role": "user", "content": p},
                                    {"role": "assistant", "content": c}], where)
        if isinstance(p, list) and isinstance(c, list):
            return _check_messages(p + c, where)
        raise ValueError(f"{where}: 'prompt' and 'completion' must both be strings or both be "
                         f"lists of messages")
    raise ValueError(f"{where}: expected 'messages', or 'prompt' and 'completion'")


def check_files(paths: Sequence[os.PathLike | str]) -> None:
    """Check the Parquet files among ``paths`` (readable, with chat columns) without reading
    their rows. Raises ValueError naming the file (``parquet.chat_columns``)."""
    for path in paths:
        if parquet.is_parquet(path):
            parquet.chat_columns(path)


def read_conversations(paths: Sequence[os.PathLike | str]) -> Iterator[tuple[str, list[dict]]]:
    """Yield ("file:line", messages) for every non-blank line of the JSONL files and
    ("file:row N", messages) for every row of the Parquet files, in order."""
    for path in paths:
        if parquet.is_parquet(path):
            columns = parquet.chat_columns(path)
            for row, values in parquet.iter_rows(path, columns):
                where = f"{path}:row {row}"
                yield where, parse_conversation(values, where)
            continue
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = decode_line(raw, path, lineno)
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
                yield where, parse_conversation(obj, where)


# ----------------------------------------------------------------------------------------------
# Tokenising
# ----------------------------------------------------------------------------------------------


@dataclass
class ChatTokenizer:
    """A checkpoint's ``tokenizer.json`` plus its chat template.

    Special tokens in the rendered text are recognised (the template writes them); none are
    added. ``eos_id``/``pad_id``: the config's ``eos_token``/``pad_token`` (pad: EOS if absent,
    logged once per tokenizer file; the answers' EOS stay trained, the loss mask marks them).
    `load` raises ValueError for an eos_token or pad_token that is not a token of the file.
    """
    tokenizer: Tokenizer
    template: ChatTemplate
    path: pathlib.Path
    eos_id: int
    pad_id: int

    @classmethod
    def load(cls, tokenizer_path: os.PathLike | str,
             template_path: os.PathLike | str | None = None) -> "ChatTokenizer":
        path = pathlib.Path(tokenizer_path)
        tok = read_tokenizer(path)
        tok.encode_special_tokens = False
        tok.no_padding()
        tok.no_truncation()
        template = load_chat_template(path, template_path)
        eos = template.special.get("eos_token")
        if eos is None or tok.token_to_id(eos) is None:
            raise ValueError(f"{template.source}: eos_token {eos!r} is not a token of {path}")
        eos_id = tok.token_to_id(eos)
        pad = template.special.get("pad_token")
        if pad is not None and tok.token_to_id(pad) is None:
            raise ValueError(f"{template.source}: pad_token {pad!r} is not a token of {path}")
        pad_id = eos_id if pad is None else tok.token_to_id(pad)
        if pad_id == eos_id:
            warn_pad_is_eos(path, eos_id)
        return cls(tok, template, path, eos_id, pad_id)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode_chat(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(ids [N] int32, trained [N] bool) of one conversation."""
        return self.encode_chats([messages])[0]

    def encode_chats(self, conversations: Sequence[list[dict]]
                     ) -> list[tuple[np.ndarray, np.ndarray]]:
        rendered = [self.template.assistant_spans(m) for m in conversations]
        encs = self.tokenizer.encode_batch([t for t, _ in rendered], add_special_tokens=False)
        out = []
        for (_, spans), enc in zip(rendered, encs):
            ids = np.asarray(enc.ids, np.int32)
            out.append((ids, tokens_in_spans(enc.offsets, spans)))
        return out


def tokens_in_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
                    ) -> np.ndarray:
    """[N] bool: token k's character range [s, e) overlaps one of the (sorted) spans."""
    out = np.zeros(len(offsets), bool)
    j = 0
    for k, (s, e) in enumerate(offsets):
        while j < len(spans) and s >= spans[j][1]:
            j += 1
        if j == len(spans):
            break
        out[k] = e > spans[j][0]
    return out


# ----------------------------------------------------------------------------------------------
# Dataset with truncation
# ----------------------------------------------------------------------------------------------


@dataclass
class ChatStats:
    """What became of the conversations read (every one is counted in exactly one of kept,
    dropped_too_long, dropped_no_answer)."""
    conversations: int = 0
    kept: int = 0
    dropped_too_long: int = 0      # longer than seq_len + 1 and not truncated (or cannot be)
    dropped_no_answer: int = 0     # no trained token left (after cut_tail, or empty answers)
    truncated: int = 0             # kept, but shortened (drop_turns / cut_tail)
    control_text: int = 0          # conversations with an added token's text in a message
    tokens: int = 0                # tokens of the kept conversations
    trained_tokens: int = 0        # of which trained (assistant) tokens

    def summary(self, truncation: str, limit: int) -> str:
        frac = self.trained_tokens / max(self.tokens, 1)
        return (f"{self.conversations} conversations: {self.kept} kept ({self.truncated} "
                f"shortened by truncation={truncation}), {self.dropped_too_long} dropped as longer "
                f"than {limit} tokens, {self.dropped_no_answer} dropped with no answer token; "
                f"{self.tokens} tokens, {self.trained_tokens} trained ({frac:.1%})"
                + (f"; {self.control_text} with special-token text inside a message, encoded "
                   f"as those tokens" if self.control_text else ""))


@dataclass
class ChatDataset:
    """Tokenised conversations: ``ids[i]`` [N_i] int32, ``trained[i]`` [N_i] bool, ``where[i]``
    ("file:line"), each N_i <= seq_len + 1."""
    ids: list[np.ndarray] = field(default_factory=list)
    trained: list[np.ndarray] = field(default_factory=list)
    where: list[str] = field(default_factory=list)
    stats: ChatStats = field(default_factory=ChatStats)

    def __len__(self) -> int:
        return len(self.ids)

    def subset(self, keep: Sequence[int]) -> "ChatDataset":
        ds = ChatDataset([self.ids[i] for i in keep], [self.trained[i] for i in keep],
                         [self.where[i] for i in keep])
        ds.stats = ChatStats(conversations=len(keep), kept=len(keep),
                             tokens=sum(len(a) for a in ds.ids),
                             trained_tokens=sum(int(t[1:].sum()) for t in ds.trained))
        return ds


def _exchange_starts(messages: list[dict]) -> tuple[int, list[int]]:
    """(number of leading system messages, indices of user messages after the first exchange)."""
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    starts = [i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user"]
    return head, starts


def _nothing_left(name: str, per_file: dict[str, list[int]], seq_len: int,
                  truncation: str) -> str:
    """The one-line reason why ``name``'s files left no conversation (see build_dataset)."""
    why = []
    for path, (n, too_long, no_answer) in per_file.items():
        if n == 0:
            why.append(f"{path} is empty")
            continue
        parts = ([f"{too_long} longer than data.seq_len={seq_len} allows ({seq_len + 1} tokens; "
                  f"data.chat_truncation={truncation})"] if too_long else []) + \
                ([f"{no_answer} with no answer token left"] if no_answer else [])
        why.append(f"{path}: all {n} conversation{'s' if n > 1 else ''} dropped, "
                   f"{' and '.join(parts)}")
    more = f"; and {len(why) - 3} more files" if len(why) > 3 else ""
    return f"{name}: no conversations left to train on: {'; '.join(why[:3])}{more}"


def build_dataset(paths: Sequence[os.PathLike | str], tok: ChatTokenizer, seq_len: int,
                  truncation: str = "drop", chunk: int = 256, name: str = "data.train"
                  ) -> ChatDataset:
    """Read, render, tokenise and truncate every conversation of the JSONL / Parquet files.

    Each kept conversation has at most ``seq_len + 1`` tokens (one row). Logs the counts (a
    warning when anything was dropped or shortened); they are in ``.stats``.
    ``name``: the config field listing ``paths``, for errors.
    Raises ValueError for a bad line, row or file (module docstring), and naming ``name``, each
    file and why (empty; all dropped as too long or without an answer) when no conversation is
    kept.
    """
    if truncation not in TRUNCATION:
        raise ValueError(f"chat truncation {truncation!r}: expected one of {', '.join(TRUNCATION)}")
    check_files(paths)
    limit = seq_len + 1
    ds = ChatDataset()
    st = ds.stats
    per_file = {str(p): [0, 0, 0] for p in paths}  # conversations, too long, no answer left

    def keep(path, where, ids, trained, shortened=False):
        if not trained[1:].any():  # the first token is never a target
            st.dropped_no_answer += 1
            per_file[path][2] += 1
            return
        st.truncated += shortened
        ds.ids.append(ids)
        ds.trained.append(trained)
        ds.where.append(where)
        st.kept += 1
        st.tokens += len(ids)
        st.trained_tokens += int(trained[1:].sum())

    def encode(where, convs):
        try:
            return tok.encode_chats(convs)
        except (jinja2.TemplateError, TypeError) as e:
            msg = " ".join(str(e).split()) or type(e).__name__
            raise ValueError(f"{where}: chat template error: {msg}") from None
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    added = [t.content for t in tok.tokenizer.get_added_tokens_decoder().values()]
    control = re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True))) or "(?!)")

    def flush(batch):
        if not batch:
            return
        st.control_text += sum(any(control.search(m["content"]) for m in msgs)
                               for _, _, msgs in batch)
        try:
            encoded = tok.encode_chats([m for _, _, m in batch])
        except (jinja2.TemplateError, TypeError, ValueError):
            encoded = [encode(w, [m])[0] for _, w, m in batch]  # find and name the failing line
        for (path, where, messages), (ids, trained) in zip(batch, encoded):
            st.conversations += 1
            per_file[path][0] += 1
            if len(ids) <= limit:
                keep(path, where, ids, trained)
            elif truncation == "drop":
                st.dropped_too_long += 1
                per_file[path][1] += 1
            elif truncation == "cut_tail":
                keep(path, where, ids[:limit], trained[:limit], shortened=True)
            else:  # drop_turns
                head, starts = _exchange_starts(messages)
                for s in starts:
                    ids, trained = encode(where, [messages[:head] + messages[s:]])[0]
                    if len(ids) <= limit:
                        keep(path, where, ids, trained, shortened=True)
                        break
                else:
                    st.dropped_too_long += 1
                    per_file[path][1] += 1

    batch = []
    for path in per_file:
        for where, messages in read_conversations([path]):
            batch.append((path, where, messages))
            if len(batch) == chunk:
                flush(batch)
                batch = []
    flush(batch)
    if not st.kept:
        raise ValueError(_nothing_left(name, per_file, seq_len, truncation))
    msg = st.summary(truncation, limit)
    if st.dropped_too_long or st.dropped_no_answer or st.truncated or st.control_text:
        log.warning("chat data: %s", msg)
    else:
        log.info("chat data: %s", msg)
    return ds


def split_dataset(ds: ChatDataset, val_fraction: float, seed: int = 0
                  ) -> tuple[ChatDataset, ChatDataset]:
    """(train, val) by a stable hash of ``f"{seed}:{file name}:{line}"``; val_fraction in [0, 1).

    The file's directory is left out of the hash, so the split stays the same when the data
    moves (another mount point, another host, a relative path from another directory)."""
    h = [int.from_bytes(hashlib.sha256(f"{seed}:{os.path.basename(w)}".encode()).digest()[:8],
                        "big") / 2.0**64 for w in ds.where]
    val = [i for i, x in enumerate(h) if x < val_fraction]
    train = [i for i, x in enumerate(h) if x >= val_fraction]
    return ds.subset(train), ds.subset(val)


# ----------------------------------------------------------------------------------------------
# Packed loader
# ----------------------------------------------------------------------------------------------


class ChatLoader:
    """Infinite, shuffled, resumable packed chat batches; plus a finite validation pass.

    Same interface as ``loader.PackedLoader`` (iteration, ``iter_epoch_once``, ``state``,
    ``restore``, ``num_tokens``). Args: ``ds`` the tokenised conversations; ``batch_size`` global
    rows per batch; ``seq_len`` T; ``pad_id``; ``seed``/``shuffle``; ``process_index``,
    ``process_count``: this host's rows of each global batch. Yields dicts of numpy arrays
    (module docstring), leading dim ``batch_size // process_count``.
    """

    def __init__(self, ds: ChatDataset, batch_size: int, seq_len: int, pad_id: int,
                 seed: int = 0, shuffle: bool = True, process_index: int = 0,
                 process_count: int = 1):
        if batch_size % process_count:
            raise ValueError(f"batch_size {batch_size} not divisible by process_count "
                             f"{process_count}")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in [0, {process_count})")
        if not len(ds):
            raise ValueError("ChatLoader: no conversations left to train on")
        if max(len(a) for a in ds.ids) > seq_len + 1:
            raise ValueError(f"ChatLoader: a conversation is longer than seq_len + 1 = "
                             f"{seq_len + 1} tokens (build the dataset with this seq_len)")
        self.ds, self.batch_size, self.seq_len, self.pad_id = ds, batch_size, seq_len, pad_id
        self.seed, self.shuffle = seed, shuffle
        self.process_index, self.process_count = process_index, process_count
        self.cursor = [0, 0]  # [epoch, index into that epoch's order]
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int, shuffle: bool) -> np.ndarray:
        if not shuffle:
            return np.arange(len(self.ds))
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = np.random.default_rng(self.seed + epoch).permutation(len(self.ds))
        return self._orders[epoch]

    def _batch(self, cursor: list[int], shuffle: bool, finite: bool
               ) -> dict[str, np.ndarray] | None:
        """Pack the next conversations from ``cursor`` (advanced in place) into one batch."""
        T, R = self.seq_len, self.batch_size
        rows: list[list[int]] = [[] for _ in range(R)]
        fill = [0] * R
        while True:
            epoch, i = cursor
            order = self._order(epoch, shuffle)
            if i == len(order):
                if finite:
                    break
                cursor[:] = [epoch + 1, 0]
                continue
            c = int(order[i])
            n = len(self.ds.ids[c])
            r = next((r for r in range(R) if fill[r] + n <= T + 1), None)
            if r is None:
                break
            rows[r].append(c)
            fill[r] += n
            cursor[1] += 1
        if not any(fill):
            return None
        per = R // self.process_count
        lo = self.process_index * per
        out = [self._row(rows[r]) for r in range(lo, lo + per)]
        return {k: np.concatenate([o[k] for o in out]) for k in out[0]}

    def _row(self, convs: list[int]) -> dict[str, np.ndarray]:
        T = self.seq_len
        if not convs:
            return pack_rows(np.zeros(0, np.int32), np.zeros(0, np.int32), 1, T, self.pad_id)
        tokens = np.concatenate([self.ds.ids[c] for c in convs])
        serial = np.concatenate([np.full(len(self.ds.ids[c]), s, np.int32)
                                 for s, c in enumerate(convs)])
        trained = np.zeros(T + 1, bool)
        t = np.concatenate([self.ds.trained[c] for c in convs])
        trained[:len(t)] = t
        row = pack_rows(tokens, serial, 1, T, self.pad_id)
        row["loss_mask"] = row["loss_mask"] * trained[None, 1:]
        return row

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return self._batch(self.cursor, self.shuffle, finite=False)

    def iter_epoch_once(self, max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """One unshuffled pass over the conversations (validation), independent of the training
        cursor; rows left empty at the end are padding; at most ``max_batches`` batches."""
        cursor, n = [0, 0], 0
        while max_batches is None or n < max_batches:
            batch = self._batch(cursor, shuffle=False, finite=True)
            if batch is None:
                return
            n += 1
            yield batch

    def num_tokens(self) -> int:
        """Tokens in one epoch."""
        return sum(len(a) for a in self.ds.ids)

    def state(self) -> dict:
        """JSON-serialisable position: the next conversation of the epoch order."""
        return {"version": _STATE_VERSION, "kind": "chat", "seed": self.seed,
                "shuffle": self.shuffle, "num_docs": len(self.ds), "lanes": self.batch_size,
                "cursor": list(self.cursor)}

    def restore(self, state: dict) -> None:
        """Continue from ``state()`` of a loader over the same conversations, seed, shuffle and
        batch_size. Raises ValueError naming the first mismatch."""
        check_state(state, self.state(), ("kind", "version", "seed", "shuffle", "num_docs", "lanes"))
        epoch, i = (int(x) for x in state["cursor"])
        if epoch < 0 or not 0 <= i <= len(self.ds):
            raise ValueError(f"loader state: cursor {state['cursor']} out of range")
        self.cursor = [epoch, i]


def build_loaders(train_paths: Sequence[os.PathLike | str],
                  val_paths: Sequence[os.PathLike | str], tokenizer_path: os.PathLike | str,
                  *, seq_len: int, rows: int, val_rows: int, seed: int = 0,
                  truncation: str = "drop", template_path: os.PathLike | str | None = None,
                  val_fraction: float = 0.0, process_index: int = 0, process_count: int = 1
                  ) -> tuple[ChatTokenizer, ChatLoader, ChatLoader | None]:
    """(tokenizer, train loader of ``rows`` rows, validation loader of ``val_rows`` rows or None).

    Without ``val_paths``, a ``val_fraction`` of the training conversations (stable hash of
    file name and line, see ``split_dataset``) is held out for validation. Parquet files are
    checked before the tokenizer is loaded; errors as ``build_dataset`` (named ``data.train`` /
    ``data.validation``).
    """
    check_files(list(train_paths) + list(val_paths))
    tok = ChatTokenizer.load(tokenizer_path, template_path)
    train = build_dataset(train_paths, tok, seq_len, truncation, name="data.train")
    val = (build_dataset(val_paths, tok, seq_len, truncation, name="data.validation")
           if val_paths else None)
    if val is None and val_fraction > 0:
        n = len(train)
        train, val = split_dataset(train, val_fraction, seed)
        log.info("chat data: %d conversations held out for validation (val_fraction %g)",
                 len(val), val_fraction)
        if not len(train):
            raise ValueError(f"data.train: no conversations left to train on: all {n} were held "
                             f"out for validation by data.val_fraction={val_fraction:g}; add "
                             f"conversations, name data.validation files or lower it")
    mk = lambda ds, n, sh: ChatLoader(ds, n, seq_len, tok.pad_id, seed, sh,  # noqa: E731
                                      process_index, process_count)
    return tok, mk(train, rows, True), (mk(val, val_rows, False) if val is not None and len(val)
                                         else None)


def loaders_from_config(d, rows: int, process_index: int = 0, process_count: int = 1
                        ) -> tuple[ChatTokenizer, ChatLoader, ChatLoader | None]:
    """``build_loaders`` for a run's ``data`` config section (``format: chat``): sources from
    ``d.train``/``d.validation`` (files, directories, globs); validation loader of
    ``d.batch_size`` rows; without ``d.validation``, ``d.val_fraction`` of the conversations."""
    val_paths = expand_sources(d.validation, "data.validation") if d.validation else []
    return build_loaders(expand_sources(d.train, "data.train"), val_paths, d.tokenizer,
                         seq_len=d.seq_len, rows=rows, val_rows=d.batch_size, seed=d.seed,
                         truncation=d.chat_truncation, template_path=d.chat_template,
                         val_fraction=0.0 if val_paths else d.val_fraction,
                         process_index=process_index, process_count=process_count)
