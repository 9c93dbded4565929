"""The packages are layers (docs/architecture.md): no module imports one of a higher layer,
not even inside a function, no modules import each other in a circle, and reporting loads no
model (it reaches no model loader, not even through another module)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src"

LAYERS = [
    (
        "graftrl",
        "graftrl.errors",
        "graftrl.files",
        "graftrl.console",
        "graftrl.interrupts",
        "graftrl.machine",
        "graftrl.workers",
    ),
    ("graftrl.core",),
    ("graftrl.methods",),
    ("graftrl.storage",),
    ("graftrl.config",),
    ("graftrl.models",),
    ("graftrl.verifiers",),
    ("graftrl.evaluation",),
    ("graftrl.embedded",),
    ("graftrl.training",),
    ("graftrl.reporting",),
    ("graftrl.experiments",),
    ("graftrl.cli", "graftrl.integrations"),
]
"""Bottom to top; a module may import its own package and the layers below its own. Packages that
share a layer (the CLI and the integrations, side by side at the top) do not import each other."""
FORBIDDEN = {
    ("graftrl.integrations", "graftrl.reporting"),
    ("graftrl.integrations", "graftrl.experiments"),
    ("graftrl.reporting", "graftrl.models"),
}
"""Pairs the ranks allow that a package's docstring rules out."""
REPORTING_MAY_IMPORT_FROM_TRAINING = ("graftrl.training.log_schema",)
"""Reporting loads no model: of training, it imports only these (the declared metrics keys), and
nothing it imports, directly or through another module, is of models or the rest of training."""
INTEGRATIONS_MAY_IMPORT = (
    "graftrl.core",
    "graftrl.methods",
    "graftrl.storage",
    "graftrl.models",
    "graftrl.verifiers",
    "graftrl.training.trajectories",
    "graftrl.training.peer_sources",
    "graftrl.config.rewards",
    "graftrl.config.peers",
)
"""Besides the top-level utilities (the first layer) and themselves: what ``graftrl.integrations``
says it imports (its docstring names each)."""


def module_names() -> dict[str, Path]:
    names = {}
    for path in (SRC / "graftrl").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported graftrl module: line}, every import statement (module level or not)."""
    modules = module_names()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # `from pkg import name`: the package
                    target = target.rpartition(".")[0]
                if target.startswith("graftrl") and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def package(module: str) -> str:
    """The layer table's entry a module belongs to (the longest matching prefix)."""
    entries = [entry for layer in LAYERS for entry in layer]
    return max((e for e in entries if module == e or module.startswith(e + ".")), key=len)


def rank(entry: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if entry in layer)


def test_every_package_is_in_the_layer_table():
    assert {package(module) for module in module_names()} <= {e for layer in LAYERS for e in layer}


def test_no_import_goes_up_the_layers():
    wrong = []
    for module, edges in import_graph().items():
        own = package(module)
        for target, line in edges.items():
            other = package(target)
            if other == own:
                continue
            if rank(other) >= rank(own) or (own, other) in FORBIDDEN:
                wrong.append(f"{module} line {line} imports {target} ({own} may not import {other})")
    assert not wrong, "\n".join(wrong)


def test_integrations_import_only_what_their_docstring_names():
    import graftrl.integrations

    docstring = " ".join((graftrl.integrations.__doc__ or "").split())
    unnamed = [name for name in INTEGRATIONS_MAY_IMPORT if name.removeprefix("graftrl.") not in docstring]
    assert not unnamed, f"graftrl.integrations' docstring does not name {unnamed}"
    allowed = set(LAYERS[0]) | {"graftrl.integrations"}
    wrong = [
        f"{module} line {line} imports {target}"
        for module, edges in import_graph().items()
        if package(module) == "graftrl.integrations"
        for target, line in edges.items()
        if package(target) not in allowed
        and not any(target == name or target.startswith(name + ".") for name in INTEGRATIONS_MAY_IMPORT)
    ]
    assert not wrong, "\n".join(wrong)


def test_reporting_loads_no_model():
    """Reporting turns finished runs into numbers, tables and figures: no module of it reaches a
    model loader (``graftrl.models``, training beyond its log schema, the experiments), not even
    through a module it imports."""
    graph = import_graph()

    def loads_models(target: str) -> bool:
        if target in REPORTING_MAY_IMPORT_FROM_TRAINING:
            return False
        return package(target) in ("graftrl.models", "graftrl.training", "graftrl.experiments")

    wrong = []
    for module in graph:
        if package(module) != "graftrl.reporting":
            continue
        seen, todo = {module: [module]}, [module]
        while todo:
            current = todo.pop()
            for target in graph[current]:
                if target in seen or target in REPORTING_MAY_IMPORT_FROM_TRAINING:
                    continue
                seen[target] = [*seen[current], target]
                if loads_models(target):
                    wrong.append(" -> ".join(seen[target]))
                else:
                    todo.append(target)
    assert not wrong, "reporting reaches a model loader:\n" + "\n".join(wrong)


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components with more than one module (iterative, so depth is no limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle():
    graph = import_graph()
    circles = strongly_connected(graph)
    described = [
        ", ".join(f"{a} -> {b} (line {graph[a][b]})" for a in circle for b in graph[a] if b in circle)
        for circle in circles
    ]
    assert not circles, "import circles:\n" + "\n".join(described)


def test_the_checks_find_a_circle_and_an_upward_import():
    """The checks themselves can fail: a made-up graph with both faults."""
    graph = {"graftrl.storage.a": {"graftrl.storage.b": 1}, "graftrl.storage.b": {"graftrl.storage.a": 2}}
    assert strongly_connected(graph) == [["graftrl.storage.a", "graftrl.storage.b"]]
    assert rank(package("graftrl.training.worker")) > rank(package("graftrl.storage.rundir"))
    assert package("graftrl.integrations.trl.trainer") == "graftrl.integrations"
    assert rank(package("graftrl.experiments.compare")) > rank(package("graftrl.reporting.plots"))
