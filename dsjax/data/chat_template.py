"""Chat templates rendered as transformers' ``apply_chat_template`` renders them, with the
character spans of the text the assistant produces (see ``dsjax.data.chat`` for the rules).
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
from dataclasses import dataclass

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")
# Unicode noncharacters that bracket the output of `{% generation %}` blocks while rendering;
# they are removed from message strings first, so only the template can produce them.
_GEN_OPEN, _GEN_CLOSE = "\ufdd0", "\ufdd1"
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body between the span markers."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller) -> str:
        return _GEN_OPEN + caller() + _GEN_CLOSE


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(v) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _strip_markers(obj):
    if isinstance(obj, str):
        return obj.replace(_GEN_OPEN, "").replace(_GEN_CLOSE, "")
    if isinstance(obj, dict):
        return {k: _strip_markers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strip_markers(v) for v in obj]
    return obj


@dataclass
class ChatTemplate:
    """A compiled chat template plus the special-token strings it is rendered with.

    ``special`` maps ``bos_token``, ``eos_token``, ... to their text; ``source`` names the file.
    A template with a syntax error raises ValueError "SOURCE:LINE: chat template syntax error:
    ..." (for a ``.json`` source "SOURCE: chat_template line LINE: ...", the line counted in
    the template string).
    """
    text: str
    special: dict[str, str]
    source: str = "<string>"

    def __post_init__(self):
        try:
            self._template = _environment().from_string(self.text)
        except jinja2.TemplateSyntaxError as e:
            msg = " ".join(e.message.split()) if e.message else type(e).__name__
            if self.source.endswith(".json"):  # the template is a string inside the JSON file
                raise ValueError(f"{self.source}: chat_template line {e.lineno}: syntax error: "
                                 f"{msg}") from None
            raise ValueError(f"{self.source}:{e.lineno}: chat template syntax error: "
                             f"{msg}") from None
        self.has_generation_blocks = bool(_GENERATION_RE.search(self.text))

    def render_with_spans(self, messages: list[dict], add_generation_prompt: bool = False
                          ) -> tuple[str, list[tuple[int, int]]]:
        """Render; returns (text, character spans of ``{% generation %}`` blocks in text).

        Raises ``jinja2.TemplateError`` from the template (e.g. ``raise_exception``).
        """
        out = self._template.render(messages=_strip_markers(messages), tools=None, documents=None,
                                    add_generation_prompt=add_generation_prompt, **self.special)
        if _GEN_OPEN not in out and _GEN_CLOSE not in out:
            return out, []
        text, spans, depth, start = [], [], 0, 0
        n = 0
        for piece in re.split(f"([{_GEN_OPEN}{_GEN_CLOSE}])", out):
            if piece == _GEN_OPEN:
                if depth == 0:
                    start = n
                depth += 1
            elif piece == _GEN_CLOSE:
                depth -= 1
                if depth == 0 and n > start:
                    spans.append((start, n))
            else:
                text.append(piece)
                n += len(piece)
        return "".join(text), spans

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The chat text, as ``apply_chat_template(..., tokenize=False)`` gives it."""
        return self.render_with_spans(messages, add_generation_prompt)[0]

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(rendered text, character spans the assistant produces), see the module docstring.

        Raises ValueError if the template renders an earlier turn differently once later turns
        follow (the prefix rule then has no answer).
        """
        text, spans = self.render_with_spans(messages)
        if self.has_generation_blocks:
            return text, spans
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[:i + 1])
            if not text.startswith(upto):
                raise ValueError(f"the chat template renders message {i} differently once later "
                                 f"messages follow, so its answer tokens cannot be found; use a "
                                 f"template with {{% generation %}} blocks")
            start = len(os.path.commonprefix([prompt, upto]))
            if start < len(upto):
                spans.append((start, len(upto)))
        return text, spans


def _read_utf8(path: pathlib.Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                         f"{e.start})") from None


def _read_json(path: pathlib.Path) -> dict:
    """A JSON object file; ValueError naming PATH (and LINE:COL) when it is not one."""
    try:
        obj = json.loads(_read_utf8(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def load_chat_template(tokenizer_path: os.PathLike | str,
                       template_path: os.PathLike | str | None = None) -> ChatTemplate:
    """The chat template of a checkpoint's tokenizer.

    Args:
      tokenizer_path: the HF ``tokenizer.json``; ``tokenizer_config.json`` beside it gives the
        special tokens and, unless overridden, the template.
      template_path: a ``tokenizer_config.json`` (its ``chat_template``) or a template file
        (e.g. ``chat_template.jinja``); default: ``chat_template.jinja`` beside the tokenizer if
        present, else ``tokenizer_config.json``'s ``chat_template``.
    A ``chat_template`` given as a list of ``{"name", "template"}`` uses the one named ``default``.
    Raises ValueError naming the file for a file that is not UTF-8 (and the line), a JSON file
    that does not parse (and line:column) or is not an object, a missing template and a
    template with a syntax error (``ChatTemplate``).
    """
    tok_dir = pathlib.Path(tokenizer_path).parent
    cfg_path = tok_dir / "tokenizer_config.json"
    cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
    if template_path is not None and pathlib.Path(template_path).suffix == ".json":
        cfg_path = pathlib.Path(template_path)
        if not cfg_path.is_file():
            raise FileNotFoundError(f"chat template file not found: {cfg_path}")
        cfg = {**cfg, **_read_json(cfg_path)}
        template_path = None
    elif template_path is None and (tok_dir / "chat_template.jinja").is_file():
        template_path = tok_dir / "chat_template.jinja"
    if template_path is not None:
        source = pathlib.Path(template_path)
        if not source.is_file():
            raise FileNotFoundError(f"chat template file not found: {source}")
        text = _read_utf8(source)
    else:
        source = cfg_path
        text = cfg.get("chat_template")
        if isinstance(text, list):
            text = next((t.get("template") for t in text if t.get("name") == "default"), None)
        if not isinstance(text, str) or not text:
            raise ValueError(f"{cfg_path}: no chat_template (give data.chat_template: a "
                             f"tokenizer_config.json or a .jinja file)")
    special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(cfg.get(k))) is not None}
    return ChatTemplate(text, special, str(source))
