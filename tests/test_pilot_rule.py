"""docs/results.md §11's table, recomputed from the committed arithmetic cells' logs by the
registered rule's own code (scripts/pilot_verdict.py)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
RECEIVERS = {"Llama": "llama-char", "GPT-2": "gpt2-bpe"}


def _pilot():
    spec = importlib.util.spec_from_file_location("pilot_verdict", ROOT / "scripts" / "pilot_verdict.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_section_11_table_is_the_logs_pilot_mass() -> None:
    pilot = _pilot()
    text = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    section = text.split("## 11. ", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\S+) \| (Llama|GPT-2) \| ([+−-][\d.]+) \| .* \| (yes|no) \|$", section, re.M)
    assert len(rows) == 16
    right = 0
    for point, receiver, documented, gain in rows:
        (folder,) = [
            f
            for f in ROOT.glob(f"experiments/worked/mastery*/mastery-{point}")
            if (f / "runs" / "graft-seed0").is_dir()
        ]
        mass = pilot.pilot_mass(folder / "runs" / "graft-seed0")[RECEIVERS[receiver]]
        assert f"{mass:+.2f}" == documented.replace("−", "-"), (point, receiver)
        right += (mass > pilot.THRESHOLD) == (gain == "yes")
    assert right == 15  # the fit the section reports: 15 of 16, after the fact
    assert f"*p0* = **{pilot.THRESHOLD}**" in section


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_record_reads_outcomes_from_committed_cells_and_scores_both_constant_rules(tmp_path) -> None:
    """On the arithmetic point 0.05 (§11's first two rows: the Llama's gain resolved, the GPT-2's
    interval reaching −0.1), verdicts calling a gain into both receivers are right once; the record
    weighs them against "never" and "always"."""
    record = _script("pilot_record")
    verdicts = tmp_path / "verdicts.json"
    gain = {"P": 3.0, "verdict": record.GAIN}
    verdicts.write_text(json.dumps({"receivers": {"llama-char": gain, "gpt2-bpe": gain}}))
    points = record.point_outcomes(verdicts, ROOT / "experiments/worked/mastery-new/mastery-0.05")
    by_receiver = {p["receiver"]: p for p in points}
    assert by_receiver["llama-char"]["happened"] is True and by_receiver["llama-char"]["right"] is True
    assert by_receiver["gpt2-bpe"]["happened"] is False and by_receiver["gpt2-bpe"]["right"] is False
    low = by_receiver["gpt2-bpe"]["graft_minus_grpo"]["low"]
    assert -0.002 < low < 0  # §11's "+3.4 [−0.1, +7.0]"
    total = record.record(points)
    assert (total["hits"], total["trials"], total["never_hits"], total["always_hits"]) == (1, 2, 1, 1)
    assert total["passed"] is False  # fewer than 8 points: every one must be right
