"""What a math response answers, before any verifier runs: pure string functions.

``extract_last_boxed`` takes a response's answer (the last ``\\boxed{...}`` / ``\\fbox{...}``, the
``last_box`` extraction); ``gold_parse_text`` is the text ``math_verify`` parses for a gold answer;
``fast_verdict`` settles the pairs math_verify is known to agree on (plain integers, identical
numeric strings) without it. :class:`graftrl.models.rewards.MathVerifier` uses all three.
"""

from __future__ import annotations

import re
from typing import Literal

Extraction = Literal["last_box", "math_verify"]
EXTRACTIONS: tuple[Extraction, ...] = ("last_box", "math_verify")

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def extract_last_boxed(text: str) -> str | None:
    """Return the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``.

    Braces are matched with nesting (``\\{``/``\\}`` and other escaped characters do not count),
    and ``\\boxed 5`` (a command followed by a bare token, which models emit too) yields ``5``.
    The last box decides: if it is unbalanced (a truncated generation) the result is None
    rather than an earlier box, because the model's final answer is incomplete.
    """
    end = len(text)
    while True:
        pos, cmd = max((text.rfind(c, 0, end), c) for c in _BOX_COMMANDS)
        if pos < 0:
            return None
        after = pos + len(cmd)
        # `\boxedfoo` is a different command name: skip it and look further left.
        if after < len(text) and text[after].isalpha():
            end = pos
            continue
        return _read_argument(text, after)


def _read_argument(text: str, start: int) -> str | None:
    """Read a LaTeX command argument at ``start``: a balanced ``{...}`` group or one bare token."""
    i = start
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    if i >= n:
        return None
    if text[i] != "{":
        j = i
        while j < n and not text[j].isspace() and text[j] != "$":
            j += 1
        token = text[i:j].rstrip(".,;")
        return token or None
    depth = 0
    j = i
    while j < n:
        ch = text[j]
        if ch == "\\":
            j += 2  # an escaped character (`\{`, `\}`, `\\`) never opens or closes a group
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None


_INTEGER = re.compile(r"-?[0-9]{1,100}")
_PLAIN_NUMBER = re.compile(r"-?(?:[0-9]+(?:,[0-9]+)*(?:\.[0-9]*)?|\.[0-9]+)")
"""A gold math_verify reads as one number with its expression parser (``1,22`` = 1.22, ``7,425,000``)."""
_DELIMITERS = ("$", "\\(", "\\[", "\\boxed", "\\fbox")


def fast_verdict(gold: str, extracted: str) -> float | None:
    """Verdict for the cases math_verify is known to agree with, else None (ask math_verify).

    Two plain integers are equal iff their values are (``007`` == ``7``, ``-0`` == ``0``).
    Identical strings (after whitespace normalisation) are equal only when they hold a digit and
    no comma: math_verify scores an identical pair 0 when it cannot parse it (``\\$``,
    ``\\ldots``, ``\\text{}``) and reads a gold ``1,22`` (1.22) and a boxed ``1,22`` ({1, 22})
    differently. Most GSM8K/MATH answers are integers, so this removes most of the ~1 ms
    ``parse`` cost per answer; tests check math_verify agrees on a battery of cases.
    """
    g, e = " ".join(gold.split()), " ".join(extracted.split())
    if _INTEGER.fullmatch(g) and _INTEGER.fullmatch(e):
        return 1.0 if int(g) == int(e) else 0.0
    if g == e and "," not in g and any(c.isdigit() for c in g):
        return 1.0
    return None


def gold_parse_text(gold: str) -> str:
    """The text handed to ``math_verify.parse`` for a gold answer.

    A gold with LaTeX delimiters (``$...$``, ``\\(...\\)``, ``\\boxed{}``) or a plain number
    (``57``, ``1,22``, ``7,425,000``) is parsed as is, as math_verify parses golds itself (so
    ``1,22`` is the decimal 1.22, not the set {1, 22}); bare LaTeX (``\\frac{3}{4}``, ``(1, 2]``,
    ``2\\sqrt{3}``), which plain ``parse`` would cut to its last number, is wrapped in ``$...$``.
    """
    stripped = gold.strip()
    if any(d in stripped for d in _DELIMITERS) or _PLAIN_NUMBER.fullmatch(stripped):
        return stripped
    return "$" + stripped + "$"
