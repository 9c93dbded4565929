"""Rewrite the config-reference table of docs/config.md from the config's fields.

    python scripts/update_config_reference.py          # rewrite docs/config.md in place
    python scripts/update_config_reference.py --check  # exit 1 when docs/config.md is stale

The table lives between the two marker comments in docs/config.md; everything else is untouched.
Run it after adding, removing or re-documenting a config field (tests/test_config_reference.py
checks it).
"""

from __future__ import annotations

import sys
from pathlib import Path

from graftrl.config import config_reference_markdown

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "config.md"
START = "<!-- config-reference:start (scripts/update_config_reference.py) -->"
END = "<!-- config-reference:end -->"


def reference_table(text: str) -> str:
    """The text between the markers (the table docs/config.md shows)."""
    if START not in text or END not in text:
        raise SystemExit(f"{REFERENCE}: the config-reference markers are missing ({START} ... {END})")
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def with_table(text: str, table: str) -> str:
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{START}\n{table}{END}{tail}"


def main(argv: list[str]) -> int:
    text = REFERENCE.read_text(encoding="utf-8")
    table = config_reference_markdown()
    if reference_table(text) == table:
        return 0
    if "--check" in argv:
        print(f"{REFERENCE}: the config reference is stale; run python scripts/update_config_reference.py")
        return 1
    REFERENCE.write_text(with_table(text, table), encoding="utf-8")
    print(f"rewrote the config reference in {REFERENCE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
