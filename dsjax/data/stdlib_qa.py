"""Question/answer conversations from the Python standard library's docstrings, for the CPU
fine-tuning demo (`configs/tiny_sft.yaml`).

  python -m dsjax.data.stdlib_qa --out runs/stdlib_qa --tokenizer runs/tiny/tokenizer.json

For every public function, class and method with a docstring in `MODULES` of the running
interpreter: user "What does `json.dumps` do?" -> assistant: the docstring's first paragraph
(whitespace collapsed, at most MAX_ANSWER characters, cut at a sentence end when longer).
Deterministic (sorted names, no network); conversations are split into train.jsonl and
val.jsonl by a CRC32 of the question. With --tokenizer, OUT also receives that tokenizer.json
and a tokenizer_config.json with `CHAT_TEMPLATE` (a DeepSeek-V2-style "User: ... Assistant: ..."
template with `{% generation %}` blocks) and its end-of-sentence / padding tokens, so
`data.tokenizer: OUT/tokenizer.json` finds the template beside it.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import shutil
import warnings
import zlib
from pathlib import Path

from dsjax.cli import run_main

MODULES = ("json", "os", "os.path", "re", "string", "textwrap", "itertools", "functools", "collections",
           "math", "random", "shutil", "pathlib", "datetime", "heapq", "bisect", "statistics", "fnmatch",
           "glob", "base64", "hashlib", "difflib", "csv", "copy", "operator", "urllib.parse", "html",
           "shlex", "zlib", "time", "calendar", "tempfile", "gzip", "zipfile", "tarfile", "struct",
           "fractions", "decimal", "enum", "dataclasses", "inspect", "logging", "argparse", "subprocess",
           "threading", "queue", "socket", "email.utils", "uuid", "pprint", "io", "codecs",
           "unicodedata", "locale", "platform", "sys", "traceback", "warnings", "weakref", "contextlib",
           "abc", "numbers", "cmath", "array", "secrets", "hmac", "binascii", "colorsys", "sqlite3",
           "xml.etree.ElementTree", "http.client", "urllib.request", "configparser", "getpass", "pickle",
           "shelve", "sched", "selectors", "signal", "mimetypes", "keyword", "tokenize", "ast", "dis")
MAX_ANSWER = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n\n"
    "{% else %}Assistant:{% generation %} {{ m['content'] }}{{ eos_token }}{% endgeneration %}\n\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")


def first_paragraph(doc: str) -> str | None:
    """The docstring's first paragraph on one line, cut to MAX_ANSWER characters at a sentence
    end (or a word); None when it is empty or only a call signature."""
    para = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    text = " ".join(para.split())
    if not text or re.fullmatch(r"[\w.]+\(.*\)( -> .*)?", text):
        return None
    if len(text) > MAX_ANSWER:
        cut = text[:MAX_ANSWER]
        end = max(cut.rfind(". "), cut.rfind(".\n"))
        text = cut[:end + 1] if end > MAX_ANSWER // 3 else cut[:cut.rfind(" ")] + " ..."
    return text


def _public(obj) -> list[tuple[str, object]]:
    out = []
    for name in sorted(dir(obj)):
        if name.startswith("_"):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out.append((name, getattr(obj, name)))
        except Exception:  # noqa: BLE001 - some attributes raise on access
            continue
    return out


def conversations(modules=MODULES) -> list[dict]:
    """[{"messages": [user, assistant]}] for every documented public callable (and the methods of
    public classes) defined in `modules`, in a fixed order; duplicates (same question) dropped."""
    out, seen = [], set()
    for mod_name in modules:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        items = []
        for name, obj in _public(mod):
            if not callable(obj) or getattr(obj, "__module__", mod_name) not in (mod_name, mod.__name__, None):
                continue
            items.append((f"{mod_name}.{name}", obj))
            if inspect.isclass(obj):
                items += [(f"{mod_name}.{name}.{m}", v) for m, v in _public(obj)
                          if callable(v) and m in vars(obj)]
        for qual, obj in items:
            doc = inspect.getdoc(obj)
            answer = first_paragraph(doc) if doc else None
            question = f"What does `{qual}` do?"
            if answer is None or question in seen:
                continue
            seen.add(question)
            out.append({"messages": [{"role": "user", "content": question},
                                     {"role": "assistant", "content": answer}]})
    return out


def write(out_dir: str | Path, tokenizer: str | Path | None = None, val_percent: int = 5) -> dict:
    """Write OUT/train.jsonl and OUT/val.jsonl (and the tokenizer files, see the module
    docstring); returns {"train": n, "val": n}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    convs = conversations()
    split = {"train": [], "val": []}
    for c in convs:
        h = zlib.crc32(c["messages"][0]["content"].encode()) % 100
        split["val" if h < val_percent else "train"].append(c)
    for name, rows in split.items():
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    if tokenizer is not None:
        tok = Path(tokenizer)
        if not tok.is_file():
            raise FileNotFoundError(f"stdlib_qa: tokenizer not found: {tok}")
        if tok.resolve() != (out / "tokenizer.json").resolve():
            shutil.copyfile(tok, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
             "pad_token": "<|pad|>", "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    return {k: len(v) for k, v in split.items()}


def main() -> None:
    def run():
        p = argparse.ArgumentParser(prog="python -m dsjax.data.stdlib_qa", description=__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--out", required=True, help="output directory")
        p.add_argument("--tokenizer", default=None, help="tokenizer.json to copy beside the data, "
                       "with a tokenizer_config.json holding the chat template")
        p.add_argument("--val-percent", type=int, default=5)
        args = p.parse_args()
        n = write(args.out, args.tokenizer, args.val_percent)
        print(f"wrote {n['train']} training and {n['val']} validation conversations to {args.out}")

    run_main("dsjax.data.stdlib_qa", run)


if __name__ == "__main__":
    main()
