"""Write docs/configuration.md from the config schema, so that the reference cannot drift.

    python docs/gen_config_reference.py            # rewrite docs/configuration.md
    python docs/gen_config_reference.py --check    # exit 1 if it is out of date

Everything comes from `aiayn.config`: the sections are the dataclass fields of `Config`, each
key's type is its annotation, its default and range come from the dataclass field, and its text
is the string literal right after the field in the class body, read with `ast` from the file
that defines that class (wherever it lives). A field without such a string is an error:
tests/unit/test_docs.py fails on it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "configuration.md"


@dataclasses.dataclass
class Key:
    name: str  # dotted: section.field, or field at the top level
    type: str
    default: Any
    range: str | None
    doc: str | None


def _class_node(cls: type) -> tuple[ast.ClassDef, str]:
    path = inspect.getsourcefile(cls)
    if path is None:
        raise RuntimeError(f"no source file for {cls.__qualname__}")
    tree = ast.parse(Path(path).read_text(), filename=path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node, path
    raise RuntimeError(f"class {cls.__name__} not found in {path}")


def field_docs(cls: type) -> dict[str, tuple[str, str | None]]:
    """{field name: (annotation as written, the string literal after it or None)}."""
    node, _ = _class_node(cls)
    out: dict[str, tuple[str, str | None]] = {}
    body = node.body
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            doc = None
            nxt = body[i + 1] if i + 1 < len(body) else None
            if (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                doc = " ".join(inspect.cleandoc(nxt.value.value).split())
            out[stmt.target.id] = (ast.unparse(stmt.annotation), doc)
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _keys_of(cls: type, prefix: str) -> list[Key]:
    docs: dict[str, tuple[str, str | None]] = {}
    for base in reversed(cls.__mro__):  # a field declared in a base class: its text is there
        if dataclasses.is_dataclass(base) and base is not object:
            docs.update(field_docs(base))
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(_default(f)):
            if prefix:  # a section within a section (decode.sampling): its keys, dotted
                keys += _keys_of(type(_default(f)), f"{prefix}{f.name}.")
            continue  # a top-level section: listed on its own
        annotation, doc = docs.get(f.name, (str(f.type), None))
        rng = f.metadata.get("range") if f.metadata else None
        rng_text = str(rng) if rng is not None and (rng.low, rng.high) != (None, None) else None
        keys.append(Key(prefix + f.name, annotation, _default(f), rng_text, doc))
        item = _list_item_section(cls, f)
        if item is not None:  # a list of sections (data.sources): each entry's keys
            keys += _keys_of(item, f"{prefix}{f.name}[].")
    return keys


def _list_item_section(cls: type, f: dataclasses.Field) -> type | None:
    hint = typing.get_type_hints(cls).get(f.name)
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if dataclasses.is_dataclass(item):
            return item
    return None


def sections() -> list[tuple[str, type, str | None, list[Key]]]:
    """[(section name or "" for the top level, class, section text, keys)] in schema order."""
    from aiayn.config import Config

    out = [("", Config, inspect.getdoc(Config), _keys_of(Config, ""))]
    top_docs = field_docs(Config)
    for f in dataclasses.fields(Config):
        value = _default(f)
        if dataclasses.is_dataclass(value):
            cls = type(value)
            text = top_docs.get(f.name, ("", None))[1] or _own_doc(cls)
            out.append((f.name, cls, text, _keys_of(cls, f.name + ".")))
    return out


def _own_doc(cls: type) -> str | None:
    doc = cls.__dict__.get("__doc__")
    if not doc or dataclasses.is_dataclass(cls) and doc.startswith(cls.__name__ + "("):
        return None  # dataclass's generated signature, not a docstring
    return " ".join(inspect.cleandoc(doc).split())


def missing() -> list[str]:
    """Dotted names of the keys that have no docstring."""
    return [k.name for _, _, _, keys in sections() for k in keys if not k.doc]


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"' if v == "" else v
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    if v is dataclasses.MISSING:
        return "(required)"
    return repr(v) if isinstance(v, float) else str(v)


def _presets() -> str:
    from aiayn import config

    presets = getattr(config, "MODEL_PRESETS", None)
    if not presets:
        return ""
    fields = list(dict.fromkeys([k for p in presets.values() for k in p]))
    lines = [
        "## Model presets",
        "",
        "`model.preset` sets these keys unless the YAML or the command line sets them:",
        "",
        "| preset | " + " | ".join(f"`{k}`" for k in fields) + " |",
        "| --- |" + " ---: |" * len(fields),
    ]
    for name, values in presets.items():
        cells = [_value(values.get(k, "")) for k in fields]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render() -> str:
    parts = [
        "# Configuration reference",
        "",
        "<!-- Generated by docs/gen_config_reference.py from the schema in aiayn.config;",
        "     do not edit: run `python docs/gen_config_reference.py` after changing a field. -->",
        "",
        "```bash",
        "aiayn train --config configs/demo.yaml train.max_steps=200 model.dropout=0.1",
        "```",
        "",
        "A run's configuration is one YAML file (see `configs/`) and `key=value` overrides",
        "with dotted keys; the command line wins over the YAML, which wins over the model",
        "preset, which wins over the defaults below. Every key is checked at load: an unknown",
        "key is an error that suggests the nearest one, a wrong type or an out-of-range value",
        "is an error naming the key, and all problems are reported together. The run writes",
        "the resolved configuration to `<run_dir>/config.yaml`. `null` is YAML's None.",
        "",
    ]
    all_sections = sections()
    parts.append(
        "Sections: "
        + ", ".join(f"[`{name}`](#{name})" for name, _, _, _ in all_sections if name)
        + "."
    )
    parts.append("")
    for name, _cls, text, keys in all_sections:
        if name:
            parts += [f"## {name}", ""]
        else:
            parts += ["## Top level", ""]
        if text and name:
            parts += [text, ""]
        for key in keys:
            facts = [f"`{key.type}`", f"default `{_value(key.default)}`"]
            if key.range:
                facts.append(f"range {key.range}")
            parts += [f"### `{key.name}`", "", "; ".join(facts) + ".", ""]
            parts += [key.doc or "(no description)", ""]
    presets = _presets()
    if presets:
        parts.append(presets)
    return "\n".join(parts).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    args = p.parse_args(argv)
    undocumented = missing()
    if undocumented:
        print(
            "config fields without a docstring (the string right after the field): "
            + ", ".join(undocumented),
            file=sys.stderr,
        )
        return 1
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is out of date: run python docs/gen_config_reference.py")
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main())
