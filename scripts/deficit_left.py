"""How much of each model's deficit GRPO's own training leaves: the statistic that picks the reward
Table 1 on code runs with (docs/results.md §12, written before either reward's outcome was read).

    PYTHONPATH=src python scripts/deficit_left.py experiments/code/lab-demo experiments/code/lab-demo-01

Per compare folder: the mean over its GRPO cells (seeds) and both receivers of
``family_all_fail/<deficit family>`` over steps 50-59, where a model's deficit family is the step
family (``EmbeddedTask.steps``) its warm-start mix gave the least (``TASK_MIXES``): the Llama's
``cond``, the GPT-2's ``mod``. Training-side logs only; no held-out figure is read.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from graftrl.embedded.mixes import TASK_MIXES
from graftrl.embedded.task import TASKS

STEPS = range(50, 60)
"""The last 10 of the cells' 60 steps."""
BASELINE = "grpo"


def deficit_families(task: str = "code") -> dict[str, str]:
    """Model -> the step family its warm-start mix gave the least."""
    steps = TASKS[task].steps
    return {model: min(steps, key=lambda f: mix.get(f, 0.0)) for model, mix in TASK_MIXES[task].items()}


def deficit_left(folder: Path, task: str = "code") -> dict[str, float]:
    """Receiver -> its deficit family's all-fail share over STEPS, mean over the GRPO cells; and
    ``mean`` over both receivers (the §12 statistic)."""
    families = deficit_families(task)
    per_model: dict[str, list[float]] = {model: [] for model in families}
    cells = sorted((folder / "runs").glob(f"{BASELINE}-seed*/metrics.jsonl"))
    if not cells:
        raise SystemExit(f"{folder}: no {BASELINE} cell with a metrics.jsonl under runs/")
    for metrics in cells:
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        for model, family in families.items():
            key = f"family_all_fail/{family}"
            values = [
                r[key] for r in rows if r["model"] == model and r["step"] in STEPS and r.get(key) is not None
            ]
            per_model[model].append(statistics.mean(values))
    out = {model: statistics.mean(values) for model, values in per_model.items()}
    out["mean"] = statistics.mean(out.values())
    out["cells"] = len(cells)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="compare output folders")
    args = parser.parse_args()
    families = deficit_families()
    for folder in args.folders:
        left = deficit_left(folder)
        receivers = ", ".join(f"{m} ({families[m]}) {left[m]:.3f}" for m in families)
        print(f"{folder}: {receivers}; mean {left['mean']:.3f} over {left['cells']} GRPO cells")


if __name__ == "__main__":
    main()
