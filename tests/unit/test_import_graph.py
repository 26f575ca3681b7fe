"""The package's modules import in one direction (STYLE.md): packages stand in layers, and a
module imports only from its own layer or below, so that no package cycle and no upward import
can come back, and no module is ever seen half-initialised. The engines share pieces that live
below them rather than importing each other.

The graph is read from the source with `ast`, imports inside functions included: a deferred
import breaks a cycle at load time only, not in the design."""

import ast
import re
from pathlib import Path

import aiayn

SRC = Path(aiayn.__file__).parent


def module_files() -> dict[str, Path]:
    files = {}
    for path in SRC.rglob("*.py"):
        parts = ["aiayn", *path.relative_to(SRC).with_suffix("").parts]
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def import_graph() -> dict[str, set[str]]:
    """Each aiayn module -> the aiayn modules it imports anywhere in its file."""
    files = module_files()
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1 parents
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + [base] if base else anchor)
                for alias in node.names:  # `from package import module` imports the module
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in files else base)
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


# Bottom up: what each layer holds (a package, or a top-level module, by its name under aiayn).
# A module imports from its own layer or below. Evaluation sits above export because
# `aiayn evaluate --engine ctranslate2` scores an export; exports decode with infer/ only.
LAYERS = [
    # errors, metric names, the process's settings, durable writes: what every layer may use.
    ("runtime", {"", "errors", "metric_names", "runtime"}),
    ("config", {"config"}),
    ("corpora", {"corpora"}),
    ("tokenizer", {"tokenizer"}),
    ("model", {"model"}),
    ("distributed", {"distributed"}),
    ("data", {"data"}),
    ("engine", {"engine"}),
    ("checkpoint", {"checkpoint"}),
    ("infer", {"infer"}),
    ("export", {"export"}),
    ("eval", {"eval"}),
    ("train", {"train"}),
    ("cli", {"cli", "__main__"}),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}

# Imports that still run upward, each with where it goes (none today); the list may only
# shrink (a fixed one must leave it, so the test fails on a stale entry too).
KNOWN_UPWARD: set[tuple[str, str]] = set()


def top(module: str) -> str:
    """The package or top-level module of aiayn that `module` belongs to ("" for aiayn)."""
    return module.split(".")[1] if "." in module else ""


def layer(module: str) -> int:
    found = [RANK[name] for name, members in LAYERS if top(module) in members]
    assert found, f"{module} is in no layer: add {top(module)!r} to LAYERS"
    return found[0]


def upward(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) for every import from a layer above the importer's."""
    return {(a, b) for a, deps in graph.items() for b in deps if layer(b) > layer(a)}


def package_graph(graph: dict[str, set[str]], ignore=frozenset()) -> dict[str, set[str]]:
    """Each package or top-level module -> those its modules import (`ignore`: edges left out)."""
    out: dict[str, set[str]] = {top(m): set() for m in graph}
    for a, deps in graph.items():
        out[top(a)] |= {top(b) for b in deps if (a, b) not in ignore and top(b) != top(a)}
    return out


def test_the_reader_sees_imports_inside_functions_and_from_packages():
    graph = import_graph()
    # export/ imports the CTranslate2 exporter inside a function (ctranslate2 is optional).
    assert "aiayn.export.ct2" in graph["aiayn.export"]
    # `from aiayn.checkpoint import reshard` is an import of the module reshard.
    assert "aiayn.checkpoint.reshard" in graph["aiayn.checkpoint.resume"]


def test_the_layer_check_finds_an_upward_import_and_a_package_cycle():
    graph = import_graph()
    graph["aiayn.model.layers"] = graph["aiayn.model.layers"] | {"aiayn.engine.optim"}
    assert ("aiayn.model.layers", "aiayn.engine.optim") in upward(graph)
    # Two packages of one layer that import each other: no module cycle, a package cycle.
    graph = import_graph()
    graph["aiayn.runtime.seeding"] = graph["aiayn.runtime.seeding"] | {"aiayn.errors"}
    graph["aiayn.errors"] = graph["aiayn.errors"] | {"aiayn.runtime.durable"}
    assert cycles(graph) == []
    found = cycles(package_graph(graph, KNOWN_UPWARD))
    assert any({"errors", "runtime"} <= set(component) for component in found)


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_engines_import_neither_the_interface_nor_each_other():
    graph = import_graph()
    engines = {
        "aiayn.engine.ddp_engine",
        "aiayn.engine.deepspeed_engine",
        "aiayn.engine.fsdp_engine",
    }
    above = engines | {"aiayn.engine.interface", "aiayn.engine.registry"}
    for engine in engines:
        assert graph[engine] & above == set(), engine


def test_no_module_of_the_package_is_in_an_import_cycle():
    assert cycles(import_graph()) == []


def test_every_module_is_in_a_layer():
    for module in import_graph():
        layer(module)


def test_no_module_imports_from_a_layer_above_its_own():
    assert upward(import_graph()) == KNOWN_UPWARD


def test_no_package_is_in_an_import_cycle():
    assert cycles(package_graph(import_graph(), KNOWN_UPWARD)) == []


def test_the_development_guide_lists_every_package_in_layer_order():
    """docs/development.md's layout: one line per package or top-level module, each one there
    is, none that is not, from the bottom layer up."""
    guide = (SRC.parents[1] / "docs" / "development.md").read_text()
    block = guide.split("## Layout", 1)[1].split("```", 2)[1]
    listed = [m.group(1) for m in re.finditer(r"^  (\w+)(?:/|\.py)\s", block, re.MULTILINE)]
    present = {p.stem for p in SRC.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert sorted(listed) == sorted(present - {"__init__", "__main__"})
    ranks = [layer(f"aiayn.{name}") for name in listed]
    assert ranks == sorted(ranks)


def test_no_module_outside_the_engines_names_an_engine():
    """A new engine is one module and one line of engine/registry.py: no other module names
    an engine (a string constant equal to a backend name, docstrings aside). The config's
    default is the one exception: the value a config file may leave out."""
    from aiayn.engine.registry import ENGINES

    found = []
    for name, path in module_files().items():
        if name.startswith("aiayn.engine"):
            continue
        tree = ast.parse(path.read_text())
        docs = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
            if isinstance(node.body[0], ast.Expr)
        }
        docs |= {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # field docs
        found += [
            (name, node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in ENGINES and id(node) not in docs
        ]
    assert found == [("aiayn.config.run", "ddp")]
