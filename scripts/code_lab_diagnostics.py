"""Training-side diagnostics of the code lab's cells over windows of steps (docs/results.md §13).

    PYTHONPATH=src python scripts/code_lab_diagnostics.py experiments/code/lab-demo experiments/code/lab-demo-01

Per compare folder, variant (GRPO, GRAFT) and receiver, means over its seeds of each step's
``failures/syntax_error`` (own responses that do not compile, of 256), ``peer_admitted`` (peer
responses that entered the loss), ``all_fail_signal_frac`` (where logged) and the training reward
on the receiver's deficit family, in the windows of ``WINDOWS``. Logs only; no held-out figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from deficit_left import deficit_families

WINDOWS = ((0, 10), (10, 30), (30, 60))
"""Steps [start, end): the first 10, the next 20, the last 30."""
VARIANTS = ("grpo", "graft")


def window_means(folder: Path, variant: str, model: str, key: str) -> list[float | None]:
    """Per window: the mean over seeds of the window's mean of ``key`` (a missing value counts 0 for
    ``peer_admitted``, where a step that moved nothing logs none; None where no cell logs ``key``)."""
    per_window: list[list[float]] = [[] for _ in WINDOWS]
    for metrics in sorted((folder / "runs").glob(f"{variant}-seed*/metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r["model"] == model]
        for slot, (start, end) in enumerate(WINDOWS):
            values = [
                r.get(key, 0 if key == "peer_admitted" else None) for r in rows if start <= r["step"] < end
            ]
            values = [0.0 if v is None and key == "peer_admitted" else v for v in values]
            values = [v for v in values if v is not None]
            if values:
                per_window[slot].append(statistics.mean(values))
    return [statistics.mean(v) if v else None for v in per_window]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="compare output folders")
    args = parser.parse_args()
    families = deficit_families()
    spans = " / ".join(f"{a}-{b - 1}" for a, b in WINDOWS)
    print(f"means per step over seeds, steps {spans}")
    for folder in args.folders:
        for model, family in families.items():
            for variant in VARIANTS:
                cells = len(list((folder / "runs").glob(f"{variant}-seed*/metrics.jsonl")))
                parts = []
                for label, key in (
                    ("syntax errors", "failures/syntax_error"),
                    ("peer admitted", "peer_admitted"),
                    ("all-fail with signal", "all_fail_signal_frac"),
                    (f"{family} reward", f"family_reward/{family}"),
                ):
                    means = window_means(folder, variant, model, key)
                    text = " / ".join(
                        "—" if m is None else f"{m:.2f}" if m < 2 else f"{m:.0f}" for m in means
                    )
                    parts.append(f"{label} {text}")
                print(f"{folder.name} {variant} -> {model} ({cells} seeds): " + "; ".join(parts))


if __name__ == "__main__":
    main()
