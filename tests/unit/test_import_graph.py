"""The package's modules import in one direction (STYLE.md): no module reaches back up to one
that imports it, so that none is ever seen half-initialised, and the engines share pieces
that live below them rather than importing each other.

The graph is read from the source with `ast`, imports inside functions included: a deferred
import breaks a cycle at load time only, not in the design."""

import ast
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


def test_the_reader_sees_imports_inside_functions_and_from_packages():
    graph = import_graph()
    # build_engine imports the DeepSpeed engine inside the function (deepspeed is slow to load).
    assert "aiayn.distributed.deepspeed_engine" in graph["aiayn.distributed.engine"]
    # `from aiayn.distributed import reshard` is an import of the module reshard.
    assert "aiayn.distributed.reshard" in graph["aiayn.checkpoint.manager"]


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_engines_import_neither_the_interface_nor_each_other():
    graph = import_graph()
    engines = {"aiayn.distributed.ddp_engine", "aiayn.distributed.deepspeed_engine"}
    for engine in engines:
        assert graph[engine] & (engines | {"aiayn.distributed.engine"}) == set(), engine


def test_no_module_of_the_package_is_in_an_import_cycle():
    assert cycles(import_graph()) == []
