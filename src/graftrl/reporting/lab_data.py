"""The lab's data files: what one experiment registered or measured, kept beside the docs that
report it rather than as constants in the code. ``docs/probe/rule.json``: the probe's verdict rule
and its track record (docs/results.md §7, read by ``probe_rule``). ``docs/mastery/line.json``: the
mastery line's points and the bars of its demo-default rule (docs/results.md §6,
docs/task_design.md, read by ``experiments.mastery``).

They are read from the checkout graftrl runs from (``provenance.SOURCE_ROOT``) and are not package
data: an installed wheel carries no lab, so there ``read_lab_data`` gives None and the commands
leave out what the lab decided (probe.md's verdict section, the mastery line's demo-default
decision and its rule test) and ask for what it chose (``--points``). In a checkout a missing or
malformed file is a one-line ``LabDataError``.
"""

from __future__ import annotations

# JSON, not YAML: the standard library reads it, numbers and strings come back as written (YAML
# reads `no` as False and `0.10` as 0.1, where a point is the string "0.10"), and it is the format
# of the results.json files the recorded figures come from.
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graftrl.errors import UserError
from graftrl.reporting.provenance import SOURCE_ROOT

RULE_FILE = "docs/probe/rule.json"
"""The probe's registered verdict rule and its track record (docs/results.md §7)."""
LINE_FILE = "docs/mastery/line.json"
"""The mastery line's points and its demo-default rule's bars (docs/results.md §6)."""


class LabDataError(UserError):
    """A lab data file of the checkout is missing or malformed; the message names the file and key."""


def checkout_root() -> Path | None:
    """The checkout graftrl runs from (``src/graftrl`` under it), or None for an installed wheel."""
    return SOURCE_ROOT if (SOURCE_ROOT / "src" / "graftrl").is_dir() else None


@dataclass(frozen=True)
class LabData:
    """One parsed lab file; its getters raise one-line errors naming the file and the key."""

    relative: str
    data: Mapping[str, Any]

    def get(self, key: str, kinds: type | tuple[type, ...], what: str) -> Any:
        if key not in self.data:
            raise LabDataError(f"{self.relative}: no `{key}` ({what})")
        value, allowed = self.data[key], kinds if isinstance(kinds, tuple) else (kinds,)
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise LabDataError(f"{self.relative}: `{key}` must be {what}, got {value!r}")
        return value

    def number(self, key: str, what: str = "a number") -> float:
        return self.get(key, (int, float), what)

    def integer(self, key: str, what: str = "an integer") -> int:
        return self.get(key, int, what)

    def text(self, key: str, what: str = "a string") -> str:
        return self.get(key, str, what)

    def section(self, key: str, what: str) -> LabData:
        return LabData(f"{self.relative} `{key}`", self.get(key, dict, what))

    def fail(self, message: str) -> LabDataError:
        return LabDataError(f"{self.relative}: {message}")


def read_lab_data(relative: str, root: Path | None = None) -> LabData | None:
    """The lab file ``relative`` (to the checkout, or to ``root``); None outside a checkout."""
    root = root if root is not None else checkout_root()
    if root is None:
        return None
    path = root / relative
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LabDataError(
            f"{relative}: lab data file missing (restore it: git checkout -- {relative})"
        ) from None
    except OSError as error:
        raise LabDataError(f"{relative}: cannot read it ({error.strerror or error})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise LabDataError(
            f"{relative}: not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})"
        ) from None
    if not isinstance(data, dict):
        raise LabDataError(f"{relative}: expected a JSON object, got {type(data).__name__}")
    return LabData(relative, data)
