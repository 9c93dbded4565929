"""docs/config.md's config table is the generator's output: every field once, one line each."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from typer.testing import CliRunner

from graftrl.cli import app
from graftrl.config import config_reference, config_reference_markdown

ROOT = Path(__file__).parents[1]


def _update_script():
    path = ROOT / "scripts" / "update_config_reference.py"
    spec = importlib.util.spec_from_file_location("update_config_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_rows_are_unique_and_one_line():
    rows = config_reference()
    keys = [key for key, _, _ in rows]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
    assert all("\n" not in cell for row in rows for cell in row)
    # The `peers` docstring spans two source lines: one table row all the same.
    (peers,) = [d for k, _, d in rows if k == "peers"]
    assert "never loaded, never trained here" in peers
    table = config_reference_markdown().splitlines()
    assert len(table) == 2 + len(rows)
    # Every row has exactly its three cells: a `|` inside a description is escaped.
    assert all(len(re.split(r"(?<!\\)\|", line)) == 5 for line in table)
    assert any("\\|" in line for line in table)  # graft.balance's |C_AB|


def test_config_doc_table_is_the_generators_output():
    """No stale, missing or repeated rows: docs/config.md holds exactly `config-reference --markdown`."""
    script = _update_script()
    assert script.REFERENCE == ROOT / "docs" / "config.md"
    doc = script.REFERENCE.read_text(encoding="utf-8")
    assert script.reference_table(doc) == config_reference_markdown(), (
        "docs/config.md's config reference is stale: run `python scripts/update_config_reference.py`"
    )
    result = CliRunner().invoke(app, ["config-reference", "--markdown"])
    assert result.exit_code == 0 and result.output == config_reference_markdown()


def test_update_script_replaces_only_the_table():
    script = _update_script()
    text = f"intro\n{script.START}\n| old | table |\n{script.END}\n\n## Next\n"
    updated = script.with_table(text, "| new |\n")
    assert updated == f"intro\n{script.START}\n| new |\n{script.END}\n\n## Next\n"
    assert script.reference_table(updated) == "| new |\n"
