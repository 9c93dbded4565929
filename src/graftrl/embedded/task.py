"""The embedded arithmetic task used by ``graftrl demo``.

A procedural family of short arithmetic problems with a direct boxed answer, small enough that
1M-parameter models learn it on a 2-core CPU in about a minute. The problem text is the bare
expression (``"37+45"``); each model spec wraps it in its own prompt template (see
:data:`graftrl.embedded.models.MODEL_SPECS`). The supervised response is
``"\\boxed{82}"`` (the EOS token is appended by the tokenizer-side code, never by this module),
so the math-verify reward on the last ``\\boxed{}`` applies unchanged.

The problems are split into *families* (sub-skills). The two embedded models are warm-started
on different family mixes, so each is strong on some families and weak-but-not-zero on the
others: that is what makes the all-fail groups of one model solvable by the other (GRAFT's
complementarity).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "FAMILIES",
    "RESPONSE_FORMAT",
    "Family",
    "Problem",
    "make_problems",
    "make_split",
    "supervised_text",
]

#: How the supervised (warm-start) response is written; ``{answer}`` is the gold answer.
RESPONSE_FORMAT = "The answer is \\boxed{{{answer}}}."


@dataclass(frozen=True)
class Problem:
    """One verifiable problem.

    Attributes:
        id: Stable identifier; equal ids mean equal problems (used for train/eval disjointness).
        problem: The problem text, e.g. ``"37+45"`` (no template, no answer).
        answer: The gold answer as a string, e.g. ``"82"``.
        family: Name of the family (sub-skill) the problem belongs to.
    """

    id: str
    problem: str
    answer: str
    family: str


@dataclass(frozen=True)
class Family:
    """A problem family: a name, a description and a generator of (problem, answer) pairs."""

    name: str
    description: str
    generate: Callable[[random.Random], tuple[str, str]]


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(1, 9)
    return f"{a}+{b}", str(a + b)


def _sub(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(1, 9)
    return f"{a}-{b}", str(a - b)


#: The families, by name: a 2-digit number plus / minus a 1-digit number.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("add", "a+b with a in [10, 99], b in [1, 9]", _add),
        Family("sub", "a-b with a in [10, 99], b in [1, 9]", _sub),
    )
}


def _weights(families: Sequence[str] | Mapping[str, float] | None) -> tuple[list[str], list[float]]:
    if families is None:
        families = list(FAMILIES)
    if isinstance(families, Mapping):
        names = [n for n, w in families.items() if w > 0]
        weights = [float(families[n]) for n in names]
    else:
        names = list(families)
        weights = [1.0] * len(names)
    if not names:
        raise ValueError("no family with a positive weight")
    for n in names:
        if n not in FAMILIES:
            raise KeyError(f"unknown family {n!r}; known: {sorted(FAMILIES)}")
    return names, weights


def make_problems(
    families: Sequence[str] | Mapping[str, float] | None,
    count: int,
    seed: int,
    exclude_ids: Iterable[str] = (),
) -> list[Problem]:
    """Generate ``count`` distinct problems, deterministically from ``seed``.

    Args:
        families: Family names (drawn uniformly) or a mapping name -> weight (drawn with those
            probabilities); ``None`` means all families, uniformly.
        count: Number of problems.
        seed: Random seed; the same arguments always give the same list.
        exclude_ids: Problem ids that must not appear (e.g. a held-out set).

    Returns:
        A list of ``count`` problems with distinct ids, none in ``exclude_ids``.
    """
    names, weights = _weights(families)
    rng = random.Random(f"graftrl-embedded:{seed}:{','.join(names)}")
    seen = set(exclude_ids)
    out: list[Problem] = []
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 100 * count + 1000:
            raise RuntimeError(f"could not generate {count} distinct problems from {names}")
        name = rng.choices(names, weights)[0]
        text, answer = FAMILIES[name].generate(rng)
        pid = f"{name}:{text}"
        if pid in seen:
            continue
        seen.add(pid)
        out.append(Problem(id=pid, problem=text, answer=answer, family=name))
    return out


def make_split(
    seed: int,
    n_train: int,
    n_eval: int,
    families: Sequence[str] | Mapping[str, float] | None = None,
) -> tuple[list[Problem], list[Problem]]:
    """Disjoint RL-train and held-out evaluation sets over ``families`` (default: all, uniform).

    The eval set is drawn first (so it does not change with ``n_train``); the train set excludes
    every eval id.
    """
    eval_set = make_problems(families, n_eval, seed=seed * 1000 + 1)
    train = make_problems(families, n_train, seed=seed * 1000 + 2, exclude_ids={p.id for p in eval_set})
    return train, eval_set


def supervised_text(problem: Problem) -> str:
    """The supervised response for ``problem`` (without EOS), e.g. ``"\\boxed{82}"``."""
    return RESPONSE_FORMAT.format(answer=problem.answer)
