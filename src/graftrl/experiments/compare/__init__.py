"""`graftrl compare`: a matrix of methods (and switches) x seeds on one base config, as one command.

Modules: ``command`` (the run: ``run_compare``, ``CompareRun``, ``CompareReport``, ``cell_names``),
``task`` (the base config and its evaluation, ``CompareTask``; the embedded task written as one),
``report`` (report.md, one render function per section; results.csv; the plots), ``exchange``
(report.md's exchange diagnostics), ``plan`` (``--plan``: the decisions read from earlier
compares) and ``rounds`` (``--seeds auto``'s rounds). The matrices, cells, launchers and paired
decisions it shares with the sweeps stay in ``graftrl.experiments``.

``from graftrl.experiments.compare import run_compare`` (or any public name of ``command``) works
as it did when this package was one module. The names are looked up on first use, not imported
here: ``cells`` and ``launchers`` import ``task``, and ``command`` imports them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CompareReport", "CompareRun", "cell_names", "run_compare"]

SUBMODULES = ("command", "exchange", "plan", "report", "rounds", "task")


def __getattr__(name: str) -> Any:
    if name.startswith("_") or name in SUBMODULES:  # a submodule not imported yet: the import system's
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from graftrl.experiments.compare import command

    try:
        return getattr(command, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
