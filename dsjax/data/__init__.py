"""Data: the stdlib / user corpus, a cached byte-level BPE tokenizer, a packed resumable loader.

Typical wiring::

    files = corpus.stdlib_files()
    train_files, val_files = corpus.split_files(files, val_fraction=0.02, seed=0)
    tok = tokenizer.load_or_train(cache_dir, vocab_size, corpus.Documents(train_files))
    train = loader.PackedLoader(corpus.Documents(train_files), tok, batch_size, seq_len, seed)
    val = loader.PackedLoader(corpus.Documents(val_files), tok, batch_size, seq_len, seed,
                              shuffle=False).iter_epoch_once(max_batches=...)

Sources may be text, JSONL or Parquet files (``parquet.py``: read a row group at a time).

Chat data (supervised fine-tuning, ``chat.py``): JSONL or Parquet conversations rendered with the
checkpoint's chat template, loss on the assistant's tokens only, packed into the same batches::

    tok, train, val = chat.build_loaders(train_files, val_files, "ckpt/tokenizer.json",
                                         seq_len=T, rows=B, val_rows=B, truncation="drop")
"""
from dsjax.data import chat
from dsjax.data.chat import ChatLoader, ChatTokenizer
from dsjax.data.corpus import (Documents, expand_sources, iter_documents, read_text,
                               resolve_sources, split_files, stdlib_files, stdlib_root)
from dsjax.data.loader import PackedLoader, pack_rows
from dsjax.data.tokenizer import Tok, fingerprint_files, load_or_train, train_bpe, wrap

__all__ = ["chat", "ChatLoader", "ChatTokenizer", "Documents", "expand_sources",
           "iter_documents", "read_text", "resolve_sources", "split_files", "stdlib_files",
           "stdlib_root", "PackedLoader", "pack_rows", "Tok", "fingerprint_files",
           "load_or_train", "train_bpe", "wrap"]
