"""A problem row as every verifier sees it (``Problem``), and the error a bad data file raises.

Its own module so that the loader (``data``) and the row formats (``data_formats``) both import
it without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from graftrl.errors import UserError

__all__ = ["DataError", "MathProblem", "Problem"]


class DataError(UserError):
    """A problem file is malformed; the message names the file, record and field to fix."""


@dataclass(frozen=True)
class Problem:
    """One prompt with what its verifier needs: a gold answer (math, match), tests (code), or any
    other fields of the row (``extra``: a user's scorer gets them all)."""

    id: str
    problem: str
    """The prompt text (the user turn; a data file's chat messages are folded into it)."""
    answer: str = ""
    """Gold answer as a string (math_verify parses strings); empty for rows checked by tests."""
    family: str | None = None
    """Optional sub-skill or subject (a record's ``family`` field): held-out pass@1 and the
    training reward are also reported per family."""
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """The row's other fields as read (``tests``, ``entry_point``, verl's ``data_source`` and
    ``extra_info``, ...), passed through to the verifier; not part of equality or hashing."""


MathProblem = Problem
"""The name of ``Problem`` before verifiers other than math existed (kept for a release)."""
