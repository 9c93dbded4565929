"""Refresh the shipped warm-started pairs (src/graftrl/embedded/shipped/) from fresh warm-starts.

    .venv/bin/python scripts/ship_warmstart.py [--cache-dir DIR]

Warm-starts each documented pair (docs/demo/<task>/provenance.json: the default `worked` pair and
the `code` pair; task, seed, stop settings) locally, never from the shipped copy, checks the
weights against the hashes documented for this machine's CPU kernels (``models_by_cpu``; add them
there first for new kernels), then writes the folders and a manifest of the kernels and every
file's SHA-256. The artifact is
installed only on machines with the same kernels. Run it when the warm-start changes, and commit
the result.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from graftrl.embedded.shipped import SHIPPED_DIR, ship
from graftrl.embedded.warmstart import prepare_embedded_models
from graftrl.machine import cpu_kernels
from graftrl.reporting.provenance import model_provenance

PROVENANCES = [
    Path(__file__).parents[1] / "docs" / "demo" / task / "provenance.json" for task in ("worked", "code")
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", type=Path, help="warm-start into this folder (default: a temporary one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folders = []
        for provenance in PROVENANCES:
            doc = json.loads(provenance.read_text())
            paths = prepare_embedded_models(
                args.cache_dir or Path(scratch),
                quick=doc["warm_start"] == "quick",
                seed=doc["seed"],
                task=doc["task"],
                progress=True,
                shipped=False,
            )
            documented = doc.get("models_by_cpu", {}).get(cpu_kernels())
            if documented is None:
                sys.exit(f"{provenance} documents no pair for this machine's CPU kernels ({cpu_kernels()})")
            for name, expected in documented.items():
                if (got := model_provenance(paths[name])) != expected:
                    sys.exit(
                        f"{name} ({doc['task']}): the warm-start gives {got}, not the documented {expected}"
                    )
            folders += [paths[name] for name in doc["models"]]
        models = ship(folders, SHIPPED_DIR)
    print(f"shipped {', '.join(models)} to {SHIPPED_DIR}")


if __name__ == "__main__":
    main()
