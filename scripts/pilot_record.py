"""The track record of docs/results.md §11's registered pilot rule on trained cells (issue 58).

Each argument pairs a pilot's committed verdicts with the compare folder whose GRPO and GRAFT cells
test them (``VERDICTS.json=COMPARE_DIR``)::

    PYTHONPATH=src python scripts/pilot_record.py \\
        experiments/code/pilot-default/verdicts.json=experiments/code/lab-demo [--json record.json]

Per receiver-point: the verdict, GRAFT − GRPO on the receiver's held-out pass@1 with compare's
default interval (paired over seeds and problems, uncorrected for the other points, as §11
registers), "beats" when its lower end is above 0, and whether the verdict was right. Then the
record: hits with a 95% Clopper-Pearson interval, and what each constant rule ("GRAFT never beats
GRPO", "GRAFT always beats GRPO") gets on the same outcomes. A point whose variants share fewer than
2 seeds has no outcome yet and is listed, not scored.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from graftrl.experiments.mastery_rule import graft_vs_grpo
from graftrl.reporting.probe_rule import score

GAIN = "GRAFT beats GRPO into this receiver"
"""The gain verdict ``pilot_verdict.py`` writes."""
MAX_MISSES = 1
"""§11's bar: at least 7 of 8 right (every one right where fewer points ran)."""


def point_outcomes(verdicts_file: Path, folder: Path) -> list[dict[str, Any]]:
    """Per receiver of one pilot: its verdict, GRAFT − GRPO in points and whether it was right."""
    verdicts = json.loads(verdicts_file.read_text())["receivers"]
    comparisons = graft_vs_grpo(folder, json.loads((folder / "results.json").read_text())["rows"])
    out = []
    for receiver, entry in sorted(verdicts.items()):
        diff = comparisons.get(receiver)
        happened = None if diff is None or diff.low is None else diff.low > 0
        predicted = entry["verdict"] == GAIN
        out.append(
            {
                "point": str(folder),
                "receiver": receiver,
                "P": entry["P"],
                "verdict": entry["verdict"],
                "graft_minus_grpo": None if diff is None else diff.as_dict(),
                "happened": happened,
                "right": None if happened is None else predicted == happened,
            }
        )
    return out


def record(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rule's record over the points with an outcome, beside both constant rules."""
    outcomes = [(p["verdict"] == GAIN, p["happened"]) for p in points if p["happened"] is not None]
    if not outcomes:
        return None
    scored = score(outcomes, 0 if len(outcomes) < 8 else MAX_MISSES)
    always_hits = sum(happened for _, happened in outcomes)
    passed = scored.passed and scored.hits > always_hits
    return {**scored.as_dict(), "always_hits": always_hits, "passed": passed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pairs", nargs="+", help="VERDICTS.json=COMPARE_DIR, one per pilot")
    parser.add_argument("--json", type=Path, help="also write the points and the record here")
    args = parser.parse_args()
    points = []
    for pair in args.pairs:
        verdicts, _, folder = pair.partition("=")
        if not folder:
            parser.error(f"{pair!r}: write VERDICTS.json=COMPARE_DIR")
        points += point_outcomes(Path(verdicts), Path(folder))
    for p in points:
        d = p["graft_minus_grpo"]
        interval = (
            "no outcome yet"
            if d is None or d["low"] is None
            else (f"{100 * d['mean']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]")
        )
        print(
            f"{p['point']} {p['receiver']}: P = {p['P']:+.2f}, {p['verdict']}; GRAFT − GRPO {interval}; "
            f"right: {p['right']}"
        )
    total = record(points)
    if total is None:
        print("no point has an outcome yet")
    else:
        print(
            f"{total['hits']} of {total['trials']} right (95% Clopper-Pearson [{total['low']:.0%}, "
            f"{total['high']:.0%}]); 'never' gets {total['never_hits']}, 'always' {total['always_hits']}; "
            f"passes the bar: {total['passed']}"
        )
    if args.json:
        args.json.write_text(json.dumps({"points": points, "record": total}, indent=2))


if __name__ == "__main__":
    main()
