"""Reading a Config from a YAML file and `section.key=value` overrides.

Precedence is command line > YAML > model preset > defaults. Every key is checked at load: an
unknown key is an error that suggests the nearest known one, a wrong type or an out-of-range
value is an error naming the key, and all problems are reported together.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from aiayn.config.checks import suggest
from aiayn.config.model import MODEL_PRESETS
from aiayn.config.schema import Config
from aiayn.errors import ConfigError


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Build a Config from a YAML file and `section.key=value` overrides, validated."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    for item in overrides:
        apply_override(raw, item)
    return config_from_dict(raw, source=str(path) if path else "<overrides>")


def keys_set(path: str | Path | None = None, overrides: list[str] = ()) -> frozenset[str]:
    """The keys (section.key) the YAML file and the overrides set, with a model preset's: what
    a load_config of the same arguments took from neither defaults nor elsewhere (init.source
    brings the model's shape from its source where the user set none)."""
    raw: dict[str, Any] = _read_yaml(Path(path)) if path is not None else {}
    for item in overrides:
        apply_override(raw, item)
    model = raw.get("model")
    if isinstance(model, dict) and model.get("preset") in MODEL_PRESETS:
        raw = {**raw, "model": {**MODEL_PRESETS[model["preset"]], **model}}
    return frozenset(
        f"{section}.{key}"
        for section, keys in raw.items()
        if isinstance(keys, dict)
        for key in keys
    )


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    errs: list[str] = []
    model_raw = raw.get("model")
    if isinstance(model_raw, dict) and model_raw.get("preset") in MODEL_PRESETS:
        raw = {**raw, "model": {**MODEL_PRESETS[model_raw["preset"]], **model_raw}}
    cfg = _build(Config, raw, "", errs)
    if not errs:
        errs = cfg.validate()
    if errs:
        lines = "\n".join(f"  - {e}" for e in errs)
        raise ConfigError(f"invalid configuration ({source}):\n{lines}")
    return cfg


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {data!r}")
    return data


def apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    try:
        value = yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
    node[parts[-1]] = value


def _build(cls, raw: Any, prefix: str, errs: list[str]):
    where = prefix.rstrip(".") or "top level"
    if not isinstance(raw, dict):
        errs.append(f"{where} must be a mapping, got {raw!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            errs.append(f"unknown key {prefix}{key}" + _suggest_key(cls, key, known, prefix))
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        value, tp = raw[f.name], hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, value, f"{prefix}{f.name}.", errs)
        elif _item_section(tp) is not None:
            kwargs[f.name] = _build_list(_item_section(tp), value, f"{prefix}{f.name}", errs)
        else:
            ok, converted, expected = _coerce(value, tp)
            if ok:
                kwargs[f.name] = converted
            else:
                hint = f.metadata.get("wrong_type")
                errs.append(
                    f"{prefix}{f.name} must be {expected}, got {value!r}"
                    + (f"; {hint}" if hint else "")
                )
    return cls(**kwargs)


def _suggest_key(cls, key: str, known: set[str], prefix: str) -> str:
    """The suggestion for an unknown key: the sections that have a key of that name where
    there are any (`max_steps=5` -> train.max_steps, `model.max_steps` -> train.max_steps),
    else the nearest name here."""
    homes = [f"{name}.{key}" for name, section in _sections().items() if key in section]
    homes = [h for h in homes if h != f"{prefix}{key}"]
    if homes:
        return f"; did you mean {' or '.join(homes)}?"
    return suggest(key, known, prefix)


def _sections() -> dict[str, set[str]]:
    """Each section of Config -> the names of its keys."""
    hints = typing.get_type_hints(Config)
    return {
        f.name: {g.name for g in dataclasses.fields(hints[f.name])}
        for f in dataclasses.fields(Config)
        if dataclasses.is_dataclass(hints[f.name])
    }


def _item_section(tp: Any) -> type | None:
    """The section class of a list-of-sections field (data.sources), else None."""
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        if dataclasses.is_dataclass(item):
            return item
    return None


def _build_list(cls, raw: Any, name: str, errs: list[str]) -> list:
    """A list of sections, each checked like a section: unknown keys, types (data.sources[1].x)."""
    if not isinstance(raw, list):
        errs.append(f"{name} must be a list of mappings, got {raw!r}")
        return []
    return [_build(cls, item, f"{name}[{i}].", errs) for i, item in enumerate(raw)]


def _coerce(value: Any, tp: Any) -> tuple[bool, Any, str]:
    """Check `value` against a field type; return (ok, converted value, expected description)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return True, None, ""
        expected = []
        for arg in args:
            if arg is type(None):
                continue
            ok, converted, exp = _coerce(value, arg)
            if ok:
                return True, converted, ""
            expected.append(exp)
        return False, None, " or ".join(expected + ["null"])
    if origin is Literal:
        choices = typing.get_args(tp)
        return value in choices, value, "one of " + ", ".join(map(str, choices))
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            return False, None, f"a list of {item_tp.__name__}"
        out = []
        for item in value:
            ok, converted, _ = _coerce(item, item_tp)
            if not ok:
                return False, None, f"a list of {item_tp.__name__}"
            out.append(converted)
        return True, out, ""
    if tp is bool:
        return isinstance(value, bool), value, "true or false"
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value, "an integer"
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string; Python does not
            try:
                return True, float(value), ""
            except ValueError:
                return False, None, "a number"
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok, float(value) if ok else None, "a number"
    if tp is str:
        ok = isinstance(value, str | int | float) and not isinstance(value, bool)
        return ok, str(value) if ok else None, "a string"
    return isinstance(value, tp), value, tp.__name__
