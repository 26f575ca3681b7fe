"""Where each value of an effective config came from: its default, the model preset, the
YAML file or a command-line override (the precedence load_config applies, read back), for
`aiayn config show`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiayn.config.loading import _read_yaml, apply_override, load_config
from aiayn.config.model import MODEL_PRESETS

SOURCES = ("default", "preset", "file", "override")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """section.key -> value; a list (data.sources) stays one value."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def effective(path: str | Path | None, overrides: list[str] = ()) -> dict[str, dict[str, Any]]:
    """{section.key: {"value": v, "source": one of SOURCES}} for every key of the config
    that `load_config(path, overrides)` builds (which also checks it)."""
    cfg = load_config(path, overrides)
    from_file = flatten(_read_yaml(Path(path))) if path is not None else {}
    raw: dict[str, Any] = {}
    for item in overrides:
        apply_override(raw, item)
    from_overrides = flatten(raw)
    preset = {f"model.{key}" for key in MODEL_PRESETS.get(cfg.model.preset or "", {})}
    out = {}
    for key, value in flatten(cfg.to_dict()).items():
        if key in from_overrides:
            source = "override"
        elif key in from_file:
            source = "file"
        elif key in preset:
            source = "preset"
        else:
            source = "default"
        out[key] = {"value": value, "source": source}
    return out
