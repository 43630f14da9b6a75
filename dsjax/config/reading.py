"""Reading a configuration: YAML files (each with optional `base:` files) applied in order over
the schema's defaults, then `--set` overrides, every scalar read as text and converted by the
type of the field it lands in; writing one back.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any

import yaml

from dsjax.config.checks import validate
from dsjax.config.schema import Config, ConfigError, _hint, _strip_optional


_NULLS = {"null", "~", "none", "None", "NULL", ""}
_TRUE = {"true", "True", "TRUE", "yes", "on"}
_FALSE = {"false", "False", "FALSE", "no", "off"}


def _convert(value: Any, tp: Any, key: str) -> Any:
    tp, optional = _strip_optional(tp)
    if optional and (value is None or (isinstance(value, str) and value in _NULLS)):
        return None
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"config: {key} must be a mapping, got {value!r}")
        return _build(tp, value, key)
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config: {key} must be a list, got {value!r}")
        items = []
        for i, v in enumerate(value):
            try:
                items.append(_convert(v, item_tp, f"{key}[{i}]"))
            except ConfigError as e:
                if getattr(e, "key", None) is None:
                    e.key = f"{key}[{i}]"
                raise
        return items
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config: {key} must be a mapping, got {value!r}")
        return dict(value)
    if isinstance(value, (dict, list)):
        raise ConfigError(f"config: {key} must be a {tp.__name__}, got {value!r}")
    text = value if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value)
    if tp is str:
        return text
    if tp is bool:
        if isinstance(value, bool):
            return value
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ConfigError(f"config: {key} must be a bool (true/false), got {text!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"config: {key} must be an int, got {value!r}")
        try:
            return int(text.replace("_", ""))
        except ValueError:
            try:
                f = float(text)
            except ValueError:
                f = math.nan
            if math.isfinite(f) and f == int(f):
                return int(f)
            raise ConfigError(f"config: {key} must be an int, got {text!r}") from None
    if tp is float:
        try:
            return float(text.replace("_", ""))
        except ValueError:
            raise ConfigError(f"config: {key} must be a float, got {text!r}") from None
    raise ConfigError(f"config: {key}: unsupported field type {tp!r}")


def _build(cls, values: dict, prefix: str, base=None):
    """Instantiate dataclass `cls` from a mapping of (text) values, over `base` if given."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in values.items():
        k = str(k)
        key = f"{prefix}.{k}" if prefix else k
        try:
            if k not in names:
                valid = [f"{prefix}.{n}" if prefix else n for n in names]
                raise ConfigError(f"config: unknown key '{key}'{_hint(key, valid)}")
            sub_base = getattr(base, k) if base is not None else None
            tp, _ = _strip_optional(hints[k])
            if dataclasses.is_dataclass(tp) and isinstance(v, dict):
                kwargs[k] = _build(tp, v, key, sub_base)
            else:
                kwargs[k] = _convert(v, hints[k], key)
        except ConfigError as e:
            if getattr(e, "key", None) is None:  # the innermost key, for the file's line of it
                e.key = key
            raise
    if base is not None:
        return dataclasses.replace(base, **kwargs)
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - all fields have defaults
        raise ConfigError(f"config: {prefix}: {e}") from None


def _deep_set(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config: --set {dotted}: '{p}' is not a section")
    node[parts[-1]] = value


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


class _Loader(yaml.BaseLoader):
    """Every scalar as text (typed later by the schema); a key given twice in one mapping is an
    error (a plain loader keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                except TypeError:
                    raise yaml.constructor.ConstructorError(
                        None, None, "a key must be a scalar", key_node.start_mark) from None
                if dup:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key '{key}'", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(text: str, where: str) -> Any:
    return _read_yaml_lines(text, where)[0]


def _read_yaml_lines(text: str, where: str) -> tuple[Any, dict[str, int]]:
    """(the document with every scalar as text, {dotted key: 1-based line}) of YAML `text`; a
    list item's key is `key[i]`. Raises ConfigError naming `where` and the line on bad YAML."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        at = f" line {line + 1}" if line is not None else ""
        raise ConfigError(f"config: {where}{at}: invalid YAML ({getattr(e, 'problem', e)})") from None
    finally:
        loader.dispose()
    lines: dict[str, int] = {}

    def walk(n, prefix: str) -> None:
        if isinstance(n, yaml.MappingNode):
            for key_node, value_node in n.value:
                key = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
                lines.setdefault(key, key_node.start_mark.line + 1)
                walk(value_node, key)
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                lines.setdefault(f"{prefix}[{i}]", item.start_mark.line + 1)
                walk(item, f"{prefix}[{i}]")

    if node is not None:
        walk(node, "")
    return data, lines


@dataclasses.dataclass
class _Layer:
    """One mapping of config values applied over the config built so far: a file's own keys
    (`where` the file, `lines` its keys' lines) or the `--set` overrides (`where` None)."""

    tree: dict
    where: str | None = None
    lines: dict = dataclasses.field(default_factory=dict)


def _line_of(key: str, lines: dict[str, int]) -> int | None:
    """The line of `key` (e.g. `data.train[1]`), else of its nearest enclosing key."""
    while key:
        if key in lines:
            return lines[key]
        key = key[:-1].rsplit("[", 1)[0] if key.endswith("]") else key.rpartition(".")[0]
    return None


def _in_file(e: ConfigError, layer: _Layer) -> ConfigError:
    """`e` with FILE:LINE (or FILE) of the key it names after "config: "."""
    if layer.where is None:
        return e
    msg = str(e).removeprefix("config: ")
    line = _line_of(getattr(e, "key", None) or "", layer.lines)
    at = f"{layer.where}:{line}" if line is not None else layer.where
    out = ConfigError(f"config: {at}: {msg}")
    out.key = getattr(e, "key", None)
    return out


def _file_layers(path: Path, chain: tuple[Path, ...] = ()) -> list[_Layer]:
    """The layers of one config file: those of its `base:` file(s) (a path or a list of paths,
    relative to this file, each applied in order, recursively), then its own keys.

    Raises:
      FileNotFoundError: the file or a base file does not exist.
      ConfigError: bad YAML or text, a top level that is not a mapping, a `base:` that is not a
        path or list of paths, or a cycle of bases (naming the files in it).
    """
    real = path.resolve()
    if real in chain:
        cycle = [str(p) for p in chain[chain.index(real):]] + [str(real)]
        raise ConfigError(f"config: base files form a cycle: {' -> '.join(cycle)}")
    if not path.is_file():
        raise FileNotFoundError(f"config: file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config: {path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start})") from None
    data, lines = _read_yaml_lines(text, str(path))
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config: {path}: top level must be a mapping of sections")
    tree = dict(data or {})
    layers: list[_Layer] = []
    if "base" in tree:
        bases = tree.pop("base")
        at = f"{path}:{lines.get('base')}"
        bases = [bases] if isinstance(bases, str) else bases
        if not isinstance(bases, list) or not all(isinstance(b, str) and b.strip() for b in bases):
            raise ConfigError(f"config: {at}: base must be a path or a list of paths (relative to "
                              f"{path.name}), got {bases!r}")
        for b in bases:
            bp = Path(b).expanduser()
            bp = bp if bp.is_absolute() else path.parent / bp
            if not bp.is_file():
                raise FileNotFoundError(f"config: {at}: base file not found: {bp}")
            layers += _file_layers(bp, chain + (real,))
    layers.append(_Layer(tree, str(path), lines))
    return layers


def load(path: str | Path | list | tuple | None = None,
         overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a `Config` from the defaults, YAML files and `key.sub=value` overrides.

    `path`: None, one file, or a list of files applied left to right over the defaults (a
    later file's keys win). A file may name its base with a top-level `base: other.yaml` (or a
    list of them), relative to the file: the base is applied first, then the file's own keys;
    bases may have bases. The overrides are applied last. Lists are replaced, not appended to.

    Raises:
      ConfigError: unknown key, wrong type, bad YAML, a cycle of bases, or an inconsistent value
        (see `validate`); a key's error in a file names FILE:LINE.
      FileNotFoundError: a YAML file or base file does not exist.
    """
    paths = [] if path is None else list(path) if isinstance(path, (list, tuple)) else [path]
    layers: list[_Layer] = []
    for p in paths:
        layers += _file_layers(Path(p))
    over: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"config: --set {item!r}: expected key.sub=value")
        key, text = item.split("=", 1)
        value = _read_yaml(text, f"--set {key}") if text.strip() else ""
        _deep_set(over, key.strip(), value)
    layers.append(_Layer(over))
    cfg = None
    for layer in layers:
        try:
            cfg = _build(Config, layer.tree, "", cfg)
        except ConfigError as e:
            raise _in_file(e, layer) from None
    validate(cfg)
    return cfg


def from_dict(tree: dict) -> Config:
    """Build and validate a `Config` from a (typed or text) nested mapping, e.g. a saved run."""
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


def to_dict(cfg) -> dict:
    """Plain nested dict (YAML/JSON-serialisable) of a config dataclass."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


