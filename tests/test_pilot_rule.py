"""docs/results.md §11's table, recomputed from the committed arithmetic cells' logs by the
registered rule's own code (scripts/pilot_verdict.py)."""

from __future__ import annotations

import importlib.util
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
            f for f in ROOT.glob(f"experiments/worked/mastery*/mastery-{point}") if (f / "runs" / "graft-seed0").is_dir()
        ]
        mass = pilot.pilot_mass(folder / "runs" / "graft-seed0")[RECEIVERS[receiver]]
        assert f"{mass:+.2f}" == documented.replace("−", "-"), (point, receiver)
        right += (mass > pilot.THRESHOLD) == (gain == "yes")
    assert right == 15  # the fit the section reports: 15 of 16, after the fact
    assert f"*p0* = **{pilot.THRESHOLD}**" in section
