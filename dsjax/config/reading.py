"""Reading a configuration: YAML overlays on the schema's defaults plus `--set` overrides, every
scalar read as text and converted by the type of the field it lands in; writing one back.
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
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
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
        if k not in names:
            valid = [f"{prefix}.{n}" if prefix else n for n in names]
            raise ConfigError(f"config: unknown key '{key}'{_hint(key, valid)}")
        sub_base = getattr(base, k) if base is not None else None
        tp, _ = _strip_optional(hints[k])
        if dataclasses.is_dataclass(tp) and isinstance(v, dict):
            kwargs[k] = _build(tp, v, key, sub_base)
        else:
            kwargs[k] = _convert(v, hints[k], key)
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
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        at = f" line {line + 1}" if line is not None else ""
        raise ConfigError(f"config: {where}{at}: invalid YAML ({getattr(e, 'problem', e)})") from None


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a `Config` from defaults, an optional YAML file and `key.sub=value` overrides.

    Raises:
      ConfigError: unknown key, wrong type, bad YAML, or an inconsistent value (see `validate`).
      FileNotFoundError: the YAML file does not exist.
    """
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config: file not found: {p}")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config: {p}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                              f"{e.start})") from None
        data = _read_yaml(text, str(p))
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"config: {p}: top level must be a mapping of sections")
        tree = data or {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"config: --set {item!r}: expected key.sub=value")
        key, text = item.split("=", 1)
        value = _read_yaml(text, f"--set {key}") if text.strip() else ""
        _deep_set(tree, key.strip(), value)
    cfg = _build(Config, tree, "")
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


