"""The hand-kept maps, checked against the code: docs/architecture.md's table and each package's
``__init__`` docstring name every module of the package, and docs/workers.md names every call of
the worker interface and every request it takes, so that a module or a call cannot land unlisted."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import typing
from pathlib import Path

ROOT = Path(__file__).parents[1]
SRC = ROOT / "src" / "graftrl"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
WORKERS = ROOT / "docs" / "workers.md"


def packages() -> dict[str, list[str]]:
    """Dotted package name -> its modules (``__main__`` is ``python -m``'s door, not a module of
    the map; a sub-package is a package of its own)."""
    found = {}
    for init in sorted(SRC.rglob("__init__.py")):
        folder = init.parent
        name = ".".join(folder.relative_to(SRC.parent).parts)
        members = [p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")]
        found[name] = sorted(members)
    return found


def architecture_rows() -> dict[str, str]:
    """Package -> the "package (modules)" cell of its row in docs/architecture.md."""
    rows = {}
    for line in ARCHITECTURE.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[1].startswith("`graftrl"):
            continue
        for package in re.findall(r"`(graftrl[\w.]*)`", cells[1]):
            rows.setdefault(package, cells[1])
        if "`graftrl.errors`" in cells[1]:  # the foundation: graftrl's own modules
            rows["graftrl"] = cells[1]
    return rows


def unlisted(members: list[str], text: str, quote: str, prefix: str = "") -> list[str]:
    """The members ``text`` does not name (``quote``d, after ``prefix``)."""
    return [m for m in members if f"{quote}{prefix}{m}{quote}" not in text]


def top(package: str) -> str:
    """The foundation's row names graftrl's own modules in full (``graftrl.errors``)."""
    return "graftrl." if package == "graftrl" else ""


def docstring(package: str) -> str:
    path = SRC.parent.joinpath(*package.split("."), "__init__.py")
    return " ".join((ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").split())


def test_the_architecture_page_lists_every_module():
    rows = architecture_rows()
    missing = []
    for package, members in packages().items():
        if not members:
            continue
        if package not in rows:
            missing.append(f"{package}: no row")
            continue
        missing += [f"{package}.{m}" for m in unlisted(members, rows[package], "`", top(package))]
    assert not missing, f"docs/architecture.md does not list {missing}"


def test_every_package_docstring_lists_its_modules():
    missing = [
        f"{package}.{m}"
        for package, members in packages().items()
        for m in unlisted(members, docstring(package), "``")
    ]
    assert not missing, f"the package docstrings do not name {missing}"


def test_a_module_added_unlisted_fails_the_check():
    """The check itself can fail: a module added to a package and to neither map."""
    package, members = "graftrl.reporting", packages()["graftrl.reporting"]
    added = [*members, "brand_new_module"]
    assert unlisted(added, architecture_rows()[package], "`") == ["brand_new_module"]
    assert unlisted(added, docstring(package), "``") == ["brand_new_module"]
    assert unlisted(["errors", "brand_new"], architecture_rows()["graftrl"], "`", top("graftrl")) == [
        "brand_new"
    ]


def test_the_workers_page_names_every_worker_call():
    from graftrl.training.backends import WorkerGroup

    calls = [
        name for name, _ in inspect.getmembers(WorkerGroup, inspect.isfunction) if not name.startswith("_")
    ]
    text = WORKERS.read_text(encoding="utf-8")
    missing = [name for name in calls if f"`{name}`" not in text and f"{name}(" not in text]
    assert calls and not missing, f"docs/workers.md does not name {missing}"


def test_the_workers_page_names_every_request():
    """Each request a ``WorkerGroup`` call takes (the annotations of its parameters) is named."""
    from graftrl.training.backends import WorkerGroup

    requests = set()
    for _, function in inspect.getmembers(WorkerGroup, inspect.isfunction):
        hints = typing.get_type_hints(function)
        requests |= {
            hint.__name__ for key, hint in hints.items() if key != "return" and dataclasses.is_dataclass(hint)
        }
    text = WORKERS.read_text(encoding="utf-8")
    assert {"RolloutRequest", "UpdateRequest", "PeerScoringRequest"} <= requests
    missing = sorted(name for name in requests if f"`{name}`" not in text)
    assert not missing, f"docs/workers.md does not name {missing}"
