"""The verdict of docs/results.md §11's registered rule from a pilot run (issue 58, item 4).

The pilot is GRAFT for 10 steps at seed 0 with the cell's settings otherwise::

    graftrl train CONFIG --set method=graft --set seed=0 --set train.steps=10 --out PILOT
    PYTHONPATH=src python scripts/pilot_verdict.py PILOT [--json verdicts.json]

Per receiver: P = moved groups per step x net w·A per moved group over the pilot's steps
(``graftrl.reporting.contrast.contrast_summary``: ``groups_per_step`` times the sum of the four
masses); "GRAFT beats GRPO into this receiver" when P > 2.47, else "no gain from GRAFT predicted".
The threshold and the step count are the registered ones; they are constants here, not options.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from graftrl.reporting.contrast import MASSES, contrast_summary
from graftrl.reporting.run_logs import read_run_metrics

THRESHOLD = 2.47
"""p0 of docs/results.md §11 (registered before any code cell)."""
PILOT_STEPS = 10


def pilot_mass(run_dir: Path) -> dict[str, float]:
    """Receiver -> P over the run's first ``PILOT_STEPS`` steps (0.0 for a receiver that moved nothing)."""
    rows = [row for row in read_run_metrics(run_dir) if row.get("step", 0) < PILOT_STEPS]
    models = {row["model"] for row in rows}
    summary = contrast_summary(rows)
    return {
        model: (summary[model]["groups_per_step"] * sum(summary[model][k] for k in MASSES))
        if model in summary
        else 0.0
        for model in sorted(models)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pilot", type=Path, help="the pilot's run folder")
    parser.add_argument("--json", type=Path, help="also write the verdicts here")
    args = parser.parse_args()
    verdicts = {
        model: {
            "P": round(mass, 3),
            "verdict": "GRAFT beats GRPO into this receiver"
            if mass > THRESHOLD
            else "no gain from GRAFT predicted",
        }
        for model, mass in pilot_mass(args.pilot).items()
    }
    for model, entry in verdicts.items():
        print(f"{model}: P = {entry['P']:+.2f} -> {entry['verdict']}")
    if args.json:
        args.json.write_text(
            json.dumps({"threshold": THRESHOLD, "steps": PILOT_STEPS, "receivers": verdicts}, indent=2)
        )


if __name__ == "__main__":
    main()
