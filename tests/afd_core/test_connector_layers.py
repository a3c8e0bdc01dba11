"""afd_core/connectors/ imports one way: its rooms are layers (read from the source with ast;
nothing is imported, so no torch is needed).

From the bottom up; a module may import its own layer and the layers below it, never one
above:

1. the interface, at the top of connectors/: `base.py` (the connector interface and its
   errors), `options.py`, `registry.py`; every room imports it, it imports none of them;
2. `transports/`: the transport interface (`transport.py`), the rendezvous store and CPU
   control channel every transport shares (`rendezvous.py`), its gate, the channels'
   address, member links, and the gloo and device transports;
3. `protocol/`: the step protocol over a transport (control and status messages, order,
   tags, the FFN inbox, heartbeats, both sides of a step);
4. `admission/`: who is in the deployment (start-up membership, formation, a restarted
   rank's rejoin, group epochs, an attention rank's return after its FFN rank was lost);
   it starts the protocol's parts (heartbeats, the rejoin thread beside the inbox);
5. the wiring, at the top of connectors/: `p2p.py` (one connector class made of the
   protocol and admission mixins), the connectors by name (`gloo.py`, `nccl.py`, and
   `device_connector.py` under every accelerator's), and `factory.py`.

Imports inside `if TYPE_CHECKING:` are annotations, not imports, for the layers (as in the
import-linter contracts of pyproject.toml); no two modules import each other, counting
every import (at module level, inside a function, or for annotations).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

SRC = REPO / "packages" / "afd-core" / "src"
ROOT = SRC / "afd_core" / "connectors"
PACKAGE = "afd_core.connectors"

# the top of connectors/: each module named in one of the two
INTERFACE = {"__init__", "base", "options", "registry"}
WIRING = {"p2p", "factory", "gloo", "nccl", "device_connector"}
LAYERS = ["interface", "transports", "protocol", "admission", "wiring"]  # bottom first


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(module: str) -> str:
    rest = module.removeprefix(PACKAGE).lstrip(".").split(".")
    if rest == [""]:
        return "interface"  # the package itself
    if len(rest) == 1:
        name = rest[0]
        if name in INTERFACE:
            return "interface"
        if name in WIRING:
            return "wiring"
        if (ROOT / name).is_dir():  # a room's __init__
            return name
        raise AssertionError(
            f"{module}: a module at the top of connectors/ must be named in INTERFACE or WIRING "
            "(tests/afd_core/test_connector_layers.py), or live in a room"
        )
    if rest[0] not in LAYERS:
        raise AssertionError(f"{module}: connectors/{rest[0]}/ is not a room of LAYERS")
    return rest[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported connectors module, line, under TYPE_CHECKING) for every import in the
    file, wherever it stands."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: list[tuple[str, int, bool]] = []

    def resolve(name: str) -> str | None:
        # the deepest connectors module the dotted name names
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if target := resolve(alias.name):
                    found.append((target, node.lineno, typing_only))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # `from pkg import module` imports the module
                if target := resolve(f"{base}.{alias.name}") or resolve(base):
                    found.append((target, node.lineno, typing_only))
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(tree, False)
    return [(t, line, typing) for t, line, typing in found if t != module]


def _graph():
    modules = _modules()
    known = set(modules)
    return modules, {m: _imports(p, m, known) for m, p in modules.items()}


def test_every_module_has_a_layer_and_the_graph_is_read():
    modules, graph = _graph()
    for module in modules:
        layer_of(module)
    # the reader works: the wiring reaches every room
    p2p = {layer_of(t) for t, _, _ in graph[f"{PACKAGE}.p2p"]}
    assert {"interface", "transports", "protocol", "admission"} <= p2p, p2p
    # each room says what it holds
    for room in LAYERS[1:-1]:
        init = ROOT / room / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"


def test_imports_go_down_the_layers():
    _, graph = _graph()
    wrong = []
    for module, imports in graph.items():
        mine = LAYERS.index(layer_of(module))
        for target, line, typing_only in imports:
            theirs = LAYERS.index(layer_of(target))
            if theirs > mine and not typing_only:
                wrong.append(
                    f"{module}:{line} imports {target}: {LAYERS[mine]} must not import "
                    f"{LAYERS[theirs]}"
                )
    assert not wrong, (
        "imports against the layers (bottom first: "
        + ", ".join(LAYERS)
        + "):\n"
        + ("\n".join(wrong))
    )


def test_no_two_modules_import_each_other():
    _, graph = _graph()
    edges = {m: {t for t, _, _ in imports} for m, imports in graph.items()}
    pairs = sorted(
        {tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges.get(b, ())}
    )
    assert not pairs, "modules that import each other:\n" + "\n".join(
        f"{a} <-> {b}" for a, b in pairs
    )


def test_no_import_cycle():
    """Not even a longer one (a -> b -> c -> a), counting run-time imports."""
    _, graph = _graph()
    edges = {
        m: sorted({t for t, _, typing_only in imports if not typing_only})
        for m, imports in graph.items()
    }
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in edges.get(m, ()):
            if state.get(t) == 1:
                return path[path.index(t) :] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))
