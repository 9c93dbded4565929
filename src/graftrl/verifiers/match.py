"""The ``match`` verifier: a response's answer against one or several gold strings, or a
multiple-choice letter. Pure string operations, in the calling process (nothing of the response runs).

What of a response is its answer is ``reward.match.extract``:

- ``last_box``: the content of the last ``\\boxed{}``/``\\fbox{}`` (``extract_last_boxed``, the math
  verifier's rule: a truncated last box is no answer);
- ``last_line``: the last non-empty line;
- ``answer_tag``: the content of the last complete ``<answer>...</answer>``, else the first
  non-empty line after the last ``Answer:`` (any case, ``**Answer:**`` too);
- ``whole``: the whole response.

How it is compared is ``reward.match.mode``:

- ``exact``: equal to a gold once white space around both is stripped;
- ``normalized`` (``normalize``): equal after case-folding, collapsing white space, and dropping the
  quotes, ``*``, ``_``, backticks and ``$`` around it and a trailing ``.``, ``,``, ``;``, ``:``,
  ``!`` or ``?``;
- ``choice`` (``choice_letters``): the response names one letter A-Z (``B``, ``(B)``, ``B)``,
  ``B.``, ``Answer: B``, ``the answer is option B``, ``\\boxed{B}``, ``B) Paris``), equal to a gold
  given as ``B``, ``(B)`` or ``b``. A response naming two different letters as its answer
  (``A or B``, ``(A), (C)``) is wrong.

The golds are the row's ``answer`` and every entry of its ``answers`` list (when the row has one);
matching any of them is correct. The reward is 1.0 or 0.0. Only the last ``MAX_CHARS`` characters of
a response are examined (an answer ends a response), so a huge response costs no more than a long
one; under ``whole`` with ``exact``/``normalized``, a response longer than that (white space around
it aside) is wrong.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from string import whitespace
from typing import TYPE_CHECKING, ClassVar

from graftrl.models.answers import extract_last_boxed
from graftrl.storage.data import Problem
from graftrl.verifiers.base import ERROR, NO_ANSWER, WRONG, Verdict, VerifierBase, check_lengths

if TYPE_CHECKING:
    from graftrl.config.rewards import RewardConfig

__all__ = ["MAX_CHARS", "MatchVerifier", "choice_letters", "extract_answer", "gold_answers", "normalize"]

MODES = ("normalized", "exact", "choice")
EXTRACTS = ("last_box", "last_line", "answer_tag", "whole")
MAX_CHARS = 32_768
"""A response's characters that are examined: its last ones."""

_WRAP = "\"'`“”‘’«»*_$" + whitespace
_TRAIL = ".,;:!?"


def normalize(text: str) -> str:
    """Case-folded, white space collapsed, quotes/``*``/``_``/backticks/``$`` around it and a
    trailing ``.,;:!?`` dropped: ``'  **Paris.** '`` -> ``paris``."""
    text = " ".join(text.casefold().split())
    return text.lstrip(_WRAP).rstrip(_WRAP + _TRAIL)


# --------------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------------

_OPEN_TAG = re.compile(r"<answer>", re.IGNORECASE)
_CLOSE_TAG = re.compile(r"</answer>", re.IGNORECASE)
_ANSWER_COLON = re.compile(r"answer\s*:", re.IGNORECASE)


def _last(pattern: re.Pattern[str], text: str, end: int | None = None) -> re.Match[str] | None:
    matches = list(pattern.finditer(text, 0, len(text) if end is None else end))
    return matches[-1] if matches else None


def _first_line(lines: Sequence[str], strip: str = "") -> str | None:
    for line in lines:
        line = line.strip().strip(strip).strip()
        if line:
            return line
    return None


def extract_answer(response: str, extract: str) -> str | None:
    """The answer part of ``response`` under ``extract`` (``EXTRACTS``), stripped; None when there is
    none. Reads the last ``MAX_CHARS`` characters only."""
    tail = response[-MAX_CHARS:]
    if extract == "last_box":
        answer = extract_last_boxed(tail)
    elif extract == "last_line":
        answer = _first_line(tail.splitlines()[::-1])
    elif extract == "answer_tag":
        close = _last(_CLOSE_TAG, tail)
        opened = _last(_OPEN_TAG, tail, close.start()) if close else None
        if close and opened:
            answer = tail[opened.end() : close.start()]
        else:
            colon = _last(_ANSWER_COLON, tail)
            answer = _first_line(tail[colon.end() :].splitlines(), "*_") if colon else None
    elif extract == "whole":
        answer = response.strip()[-MAX_CHARS:]
    else:
        raise ValueError(f"extract must be one of {EXTRACTS}, got {extract!r}")
    answer = answer.strip() if answer is not None else None
    return answer or None


# --------------------------------------------------------------------------------------------
# Multiple choice
# --------------------------------------------------------------------------------------------

_PHRASE = re.compile(r"\banswer\b\s*(?:is\b|:|=)?", re.IGNORECASE)
_LATEX = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mathit|operatorname)\b|\\[()\[\]]")
_DROP = str.maketrans("", "", "{}*$`\"'“”‘’")
_OPTION = r"(?:(?i:option|choice)\s*)?"
_SOLE = re.compile(_OPTION + r"[(\[]?([A-Za-z])[)\]]?[.:)]?")
_LEAD = re.compile(_OPTION + r"([(\[])?([A-Z])(?![A-Za-z0-9])")
_ALSO = re.compile(r"\s*(?:,|/|&|\bor\b|\band\b)\s*" + _OPTION + r"[(\[]?([A-Z])(?![A-Za-z0-9])")
_PAREN = re.compile(r"[(\[]([A-Z])[)\]]")
_BARE = re.compile(r"(?<![A-Za-z0-9\\])([A-Z])(?![A-Za-z0-9])")
_WORD_AFTER = re.compile(r"\s+(?!(?:or|and)\b)[a-z]")
_SHORT = 64
"""An answer part at most this long is scanned for bare letters (``I'd pick B``)."""


def _clean(text: str) -> str:
    return " ".join(_LATEX.sub("", text).translate(_DROP).split())


def _distinct(letters: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(letters))


def choice_letters(text: str) -> list[str]:
    """The distinct letters A-Z that ``text`` names as its answer, in order: ``[]`` for none, one for
    an answer, several for an ambiguous one.

    The part read is the last ``\\boxed{}``'s content if any, then what follows the last "answer"
    (``Answer:``, ``the answer is``); LaTeX wrappers, quotes, ``*`` and ``$`` are dropped. A part
    that is a letter (``B``, ``(b)``, ``B.``, ``option B``) names it; one that starts with a letter
    (``B) Paris``, ``(C) because``) names that letter, and a second one after ``or``, ``and``, ``,``
    or ``/`` as well; otherwise the letters in parentheses, or, in a short part, the standalone
    capitals (an ``A`` or ``I`` followed by a lower-case word is an article or pronoun).
    """
    part = text[-MAX_CHARS:]
    boxed = extract_last_boxed(part)
    narrowed = boxed is not None
    if boxed is not None:
        part = boxed
    phrase = _last(_PHRASE, part)
    if phrase is not None:
        part, narrowed = part[phrase.end() :], True
    part = _clean(part)
    sole = _SOLE.fullmatch(part)
    if sole:
        return [sole.group(1).upper()]
    lead = _LEAD.match(part)
    if lead:
        letter, rest = lead.group(2), part[lead.end() :]
        closed = rest[:1] in (")", "]")
        if closed:
            rest = rest[1:]
        also = _ALSO.match(rest)
        if also:
            return _distinct([letter, also.group(1)])
        if closed or rest == "" or rest[0] in ".:;":
            return [letter]
        if rest[0] in " ," and (narrowed or letter not in "AI" or not _WORD_AFTER.match(rest)):
            return [letter]
    paren = _PAREN.findall(part)
    if paren or len(part) > _SHORT:
        return _distinct(paren)
    bare = [
        m.group(1)
        for m in _BARE.finditer(part)
        if m.group(1) not in "AI" or not _WORD_AFTER.match(part, m.end())
    ]
    return _distinct(bare)


def _gold_letter(gold: str) -> str | None:
    sole = _SOLE.fullmatch(_clean(gold))
    return sole.group(1).upper() if sole else None


# --------------------------------------------------------------------------------------------
# The verifier
# --------------------------------------------------------------------------------------------


def gold_answers(problem: Problem) -> list[str]:
    """The row's golds: ``answer`` (when not empty) and the entries of its ``answers`` list."""
    golds = [problem.answer] if str(problem.answer).strip() else []
    extra = problem.extra.get("answers")
    if hasattr(extra, "tolist"):  # a Parquet list column read as a numpy array
        extra = extra.tolist()
    if isinstance(extra, str):
        extra = [extra]
    if isinstance(extra, list | tuple):
        golds += [str(g) for g in extra if g is not None and str(g).strip()]
    return list(dict.fromkeys(str(g) for g in golds))


_STAT_OF = {None: "correct", WRONG: "wrong", NO_ANSWER: "no_answer", ERROR: "errors"}


def _quote(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


class MatchVerifier(VerifierBase):
    """String or multiple-choice match against a row's golds (module docstring); 1.0 or 0.0."""

    kind: ClassVar[str] = "match"

    def __init__(self, mode: str = "normalized", extract: str = "last_box") -> None:
        if mode not in MODES:
            raise ValueError(f"MatchVerifier: mode must be one of {MODES}, got {mode!r}")
        if extract not in EXTRACTS:
            raise ValueError(f"MatchVerifier: extract must be one of {EXTRACTS}, got {extract!r}")
        self.mode = mode
        self.extract = extract
        self._stats = dict.fromkeys(("answers", "correct", "wrong", "no_answer", "errors"), 0)
        self._seconds = 0.0

    @classmethod
    def from_config(cls, reward: RewardConfig) -> MatchVerifier:
        """The verifier of a run's ``reward`` section (``reward.match``)."""
        return cls(mode=reward.match.mode, extract=reward.match.extract)

    def check_problem(self, problem: Problem) -> str | None:
        golds = gold_answers(problem)
        if not golds:
            return (
                f"field 'answer' is empty: problem {problem.id!r} has no gold answer (reward.kind is "
                "'match': give the gold in 'answer', or several in a list 'answers')"
            )
        if self.mode == "choice" and not any(_gold_letter(g) for g in golds):
            return (
                f"field 'answer' is not a choice letter: {_quote(golds[0])} in problem {problem.id!r} "
                "(reward.match.mode is 'choice': give the gold as a letter A-Z, such as 'B' or '(B)')"
            )
        return None

    def verify(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[Verdict]:
        check_lengths("MatchVerifier.verify", responses, problems)
        t0 = time.perf_counter()
        verdicts = [self._one(r, p) for r, p in zip(responses, problems, strict=True)]
        for v in verdicts:
            self._stats[_STAT_OF[v.failure]] += 1
        self._stats["answers"] += len(verdicts)
        self._seconds += time.perf_counter() - t0
        return verdicts

    def _one(self, response: str, problem: Problem) -> Verdict:
        problem_error = self.check_problem(problem)
        if problem_error is not None:
            return Verdict.failed(ERROR, problem_error)
        golds = gold_answers(problem)
        if self.extract == "whole" and self.mode != "choice" and len(response.strip()) > MAX_CHARS:
            return Verdict.failed(WRONG, f"wrong: answered {len(response.strip()):,} characters")
        answer = extract_answer(response, self.extract)
        if answer is None:
            return Verdict.failed(NO_ANSWER, "no answer found")
        if self.mode == "choice":
            letters = choice_letters(answer)
            if not letters:
                return Verdict.failed(NO_ANSWER, "no answer found")
            if len(letters) > 1:
                return Verdict.failed(WRONG, f"wrong: answered several letters ({', '.join(letters)})")
            if letters[0] in {_gold_letter(g) for g in golds}:
                return Verdict.correct()
            return Verdict.failed(WRONG, f"wrong: answered {letters[0]!r}")
        if self.mode == "exact":
            ok = answer in {g.strip() for g in golds}
        else:
            ok = normalize(answer) in {normalize(g) for g in golds}
        return Verdict.correct() if ok else Verdict.failed(WRONG, f"wrong: answered {_quote(answer)}")

    def stats(self) -> dict[str, float]:
        """Counters since construction: answers, correct, wrong, no_answer, errors (rows without a
        usable gold), and the seconds spent in verify()."""
        return {**self._stats, "seconds": self._seconds}
