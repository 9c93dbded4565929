"""Command line: ``graftrl train | probe | eval | import-trajectories | analyze`` (one run or config, ``runs``),
``graftrl demo | compare | sweep`` (cells on the embedded task, ``experiments``),
``graftrl config-reference | metrics-reference | estimate-memory`` (``references``) and ``graftrl verify``
(a config's verifier on given responses or on its data, ``verify``), all on the typer
app of ``common`` with its one error boundary and ``--threads``; ``errors`` words the messages."""

from __future__ import annotations

from graftrl.cli.common import app, main

# Each module registers its commands; the order of these imports is the order of `graftrl --help`.
# isort: off
from graftrl.cli import runs  # noqa: F401
from graftrl.cli import experiments  # noqa: F401
from graftrl.cli import references  # noqa: F401
from graftrl.cli import verify  # noqa: F401
# isort: on

__all__ = ["app", "main"]
