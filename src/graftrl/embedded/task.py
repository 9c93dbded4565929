"""The embedded arithmetic tasks used by ``graftrl demo`` and ``graftrl compare`` (``--task NAME``).

Two tasks, selected by name (:data:`TASKS`):

- ``arith`` (the original task, kept so old results stay reproducible): the response is a fixed
  template around the answer, ``"The answer is \\boxed{82}."``.
- ``worked``: the response is a short digit-by-digit worked solution in one format both models
  share, e.g. ``"ones 7+5=12, write 2 carry 1; tens 3+1=4. The answer is \\boxed{42}."``, so most tokens of a
  peer's response are mechanical copying that the receiver also produces, and the compatibility
  gate judges fit rather than only the answer (see docs/task_design.md).

The ``arith`` task: a procedural family of short arithmetic problems with a direct boxed answer, small enough that
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
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from graftrl.embedded.code_task import CODE_FAMILIES, CODE_STEPS, ENTRY_POINT, code_program, code_tests

__all__ = [
    "DEFAULT_TASK",
    "FAMILIES",
    "ORIGINAL_TASK",
    "REGROUPING",
    "RESPONSE_FORMAT",
    "TASKS",
    "WORKED_OUTCOMES",
    "EmbeddedTask",
    "Family",
    "Problem",
    "classify_worked",
    "fact_drill",
    "get_task",
    "make_problems",
    "make_split",
    "problem_row",
    "supervised_text",
    "worked_solution",
]

#: How the supervised (warm-start) response of the ``arith`` task is written; ``{answer}`` is the
#: gold answer. The ``worked`` task ends every solution with the same sentence.
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
    distinct: int | None = None
    """How many distinct problems it has, when that is few (the drills' 45 facts)."""


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(1, 9)
    return f"{a}+{b}", str(a + b)


def _sub(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(1, 9)
    return f"{a}-{b}", str(a - b)


#: The ``arith`` families, by name: a 2-digit number plus / minus a 1-digit number.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("add", "a+b with a in [10, 99], b in [1, 9]", _add),
        Family("sub", "a-b with a in [10, 99], b in [1, 9]", _sub),
    )
}


# ----- the worked task: a in [10, 199] plus / minus b in [1, 9], by carry / borrow -----------


def _draw(rng: random.Random, op: str, regrouping: bool) -> tuple[str, str]:
    """a op b with a in [10, 199], b in [1, 9], with or without a carry (borrow) in the ones digit.

    A borrow needs a >= 20 so the tens part stays >= 1 (no leading-zero answers).
    """
    while True:
        a, b = rng.randint(10, 199), rng.randint(1, 9)
        carries = (a % 10 + b >= 10) if op == "+" else (a % 10 < b)
        if carries == regrouping and not (op == "-" and carries and a < 20):
            return f"{a}{op}{b}", str(a + b if op == "+" else a - b)


def worked_solution(problem: str) -> str:
    """The worked solution of ``"a+b"`` / ``"a-b"`` (a in [10, 199], b a digit), without EOS.

    The ones digits first (a borrow written as a leading 1), the digit written and the carry
    (borrow) restated, then the tens part (every digit of a but the last) plus or minus the carry,
    then the answer: the tens result followed by the written digit. Most characters are copies
    (of the operands, of the previous step) that a model without the regrouping skill also
    produces::

        37+5  -> "ones 7+5=12, write 2 carry 1; tens 3+1=4. The answer is \\boxed{42}."
        32+5  -> "ones 2+5=7, write 7 carry 0; tens 3+0=3. The answer is \\boxed{37}."
        132-5 -> "ones 12-5=7, write 7 borrow 1; tens 13-1=12. The answer is \\boxed{127}."
    """
    op = "+" if "+" in problem else "-"
    left, right = problem.split(op)
    a, b = int(left), int(right)
    tens, ones = divmod(a, 10)
    if op == "+":
        ones_value = ones + b
        carry = ones_value // 10
        tens_value = tens + carry
        ones_text = f"{ones}+{b}={ones_value}, write {ones_value % 10} carry {carry}"
    else:
        carry = int(ones < b)
        ones_value = ones + 10 * carry - b
        tens_value = tens - carry
        ones_text = f"{ones + 10 * carry}-{b}={ones_value}, write {ones_value} borrow {carry}"
    answer = f"{tens_value}{ones_value % 10}"
    return f"ones {ones_text}; tens {tens}{op}{carry}={tens_value}. " + RESPONSE_FORMAT.format(answer=answer)


#: The ``worked`` families whose solution carries or borrows (the regrouping step).
REGROUPING = ("add_carry", "sub_borrow")

#: What a ``worked`` response got wrong first, in reading order (``classify_worked``):
#: ``regrouping`` the carry / borrow step (a forgotten or spurious carry, a ones minuend without its
#: borrowed ten, the carry not taken to the tens, the tens not incremented / decremented by it);
#: ``fact`` a single-digit fact (``7+3=11``); ``copy`` a copied digit, operator or word (an
#: operand, the written digit, the tens, the answer copied from the working); ``format`` not the
#: worked format at all. ``correct`` when every field is right.
WORKED_OUTCOMES = ("correct", "regrouping", "fact", "copy", "format")

_WORKED_PATTERN = re.compile(
    r"ones (\d+)([+-])(\d+)=(-?\d+), write (-?\d+) (carry|borrow) (\d+); "
    r"tens (\d+)([+-])(\d+)=(-?\d+)\. The answer is \\boxed\{(-?\d+)\}\.?"
)


def classify_worked(problem: str, response: str) -> str:
    """The first step a ``worked`` response of ``problem`` gets wrong (:data:`WORKED_OUTCOMES`).

    Every field is checked against the gold solution and the response's own earlier fields, in
    the order written, so an error is charged to the step where it first appears (a wrong fact
    whose carry then follows from it is a ``fact``)::

        classify_worked("37+5", "ones 7+5=12, write 2 carry 0; tens 3+0=3. The answer is \\boxed{32}.")
        -> "regrouping"   (the forgotten carry)
    """
    if not re.fullmatch(r"\d+[+-]\d+", problem):
        raise ValueError(f"not a worked problem: {problem!r}")
    op = "+" if "+" in problem else "-"
    left, right = problem.split(op)
    a, b = int(left), int(right)
    tens, ones = divmod(a, 10)
    regroup = int(ones + b >= 10) if op == "+" else int(ones < b)
    match = _WORKED_PATTERN.fullmatch(response.strip())
    if match is None:
        return "format"
    x, op1, y, value, written, word, carry, t, op2, carried, tens_value, answer = match.groups()
    if op1 != op or op2 != op or word != ("carry" if op == "+" else "borrow"):
        return "copy"
    if int(x) % 10 != ones or (op == "+" and int(x) != ones):
        return "copy"
    if op == "-" and int(x) != ones + 10 * regroup:
        return "regrouping"  # the ones minuend without its borrowed ten (or with a spurious one)
    if int(y) != b:
        return "copy"
    if int(value) != (int(x) + b if op == "+" else int(x) - b):
        return "fact"
    if int(written) != int(value) % 10:
        return "copy"
    if int(carry) != regroup:
        return "regrouping"
    if int(t) != tens:
        return "copy"
    if int(carried) != int(carry):
        return "regrouping"
    if int(tens_value) != (tens + regroup if op == "+" else tens - regroup):
        return "regrouping" if regroup else "copy"
    if answer != f"{tens_value}{int(written)}" if int(tens_value) else answer != written:
        return "copy"
    return "correct"


#: The ``worked`` families: addition and subtraction, each with and without regrouping.
WORKED_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("add", "a+b, a in [10, 199], b in [1, 9], no carry", lambda rng: _draw(rng, "+", False)),
        Family("add_carry", "a+b, a in [10, 199], b in [1, 9], carry", lambda rng: _draw(rng, "+", True)),
        Family("sub", "a-b, a in [10, 199], b in [1, 9], no borrow", lambda rng: _draw(rng, "-", False)),
        Family("sub_borrow", "a-b, a in [20, 199], b in [1, 9], borrow", lambda rng: _draw(rng, "-", True)),
    )
}


def _fact(rng: random.Random, op: str) -> tuple[str, str]:
    """A single-digit fact with regrouping: ones digit x + b >= 10, or (10 + x) - b with x < b."""
    while True:
        x, b = rng.randint(0, 9), rng.randint(1, 9)
        if op == "+" and x >= 1 and x + b >= 10:
            return f"{x}+{b}", str(x + b)
        if op == "-" and x < b:
            return f"{10 + x}-{b}", str(10 + x - b)


def fact_drill(problem: str) -> str:
    """The supervised response of a fact drill: the ones step alone, no carry or borrow written::

    7+5  -> "ones 7+5=12. The answer is \\boxed{12}."
    12-5 -> "ones 12-5=7. The answer is \\boxed{7}."
    """
    op = "+" if "+" in problem else "-"
    left, right = problem.split(op)
    value = int(left) + int(right) if op == "+" else int(left) - int(right)
    return f"ones {problem}={value}. " + RESPONSE_FORMAT.format(answer=value)


#: Warm-start-only families of the ``worked`` task (never RL or held-out prompts): the
#: single-digit facts of the regrouping families without the carry / borrow step, so a model can
#: know the facts sharply while its regrouping step stays partial (``graftrl sweep --knob
#: mastery``; docs/task_design.md). Their problems (a < 10, or a borrow with a < 20) never occur
#: among the four families' problems.
WORKED_DRILLS: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "add_fact", "x+b, x and b digits, x + b >= 10 (the carry's fact)", lambda rng: _fact(rng, "+"), 45
        ),
        Family("sub_fact", "(10+x)-b, x < b digits (the borrow's fact)", lambda rng: _fact(rng, "-"), 45),
    )
}


def _program_family(name: str, description: str, spec: Callable[[random.Random], str]) -> Family:
    def generate(rng: random.Random) -> tuple[str, str]:
        text = spec(rng)
        return text, code_program(text)

    return Family(name, description, generate)


#: The ``code`` families (``graftrl.embedded.code_task``): a spec in words -> its program.
CODE_TASK_FAMILIES: dict[str, Family] = {
    name: _program_family(name, description, spec) for name, (description, spec) in CODE_FAMILIES.items()
}

#: A code-task run's reward: the code verifier in its sandbox, two programs checked at once (the
#: rollouts of a step), 2 s per test (a program is one expression; the limit is for a runaway one).
CODE_REWARD = {"kind": "code", "workers": 2, "code": {"test_timeout_s": 2.0}}


@dataclass(frozen=True)
class EmbeddedTask:
    """A named embedded task: its families, how a supervised response is written, its sizes."""

    name: str
    description: str
    families: dict[str, Family]
    respond: Callable[[Problem], str]
    """The supervised response of a problem (without EOS); its last ``\\boxed{}`` is the answer."""
    max_new_tokens: int
    """Response length limit for rollouts and evaluation (the longest supervised response fits)."""
    max_positions: int
    """Position limit of the embedded models (prompt + response + EOS fit)."""
    prompt_mix: dict[str, float] | None = None
    """Family weights of the RL training and held-out prompts (None: uniform)."""
    drills: dict[str, Family] = field(default_factory=dict)
    """Families a warm-start mix may name that are never drawn otherwise (see WORKED_DRILLS)."""
    tests: Callable[[str], list[str]] | None = None
    """A problem's hidden tests (assert statements), for a task whose answer is a program: its
    rows carry ``tests`` instead of an ``answer`` (None: the answer is the last ``\\boxed{}``)."""
    steps: tuple[str, ...] = ()
    """The families that add a step, one per model's deficit (``REGROUPING``, ``CODE_STEPS``)."""
    run_config: dict[str, Any] = field(default_factory=dict)
    """Sections its run configs set beyond the demo's (the code task's ``reward`` and ``hint``)."""

    def family(self, name: str) -> Family:
        """A family or drill of the task by name."""
        return self.families.get(name) or self.drills[name]


TASKS: dict[str, EmbeddedTask] = {
    t.name: t
    for t in (
        EmbeddedTask(
            "arith",
            "2-digit +/- 1-digit, direct answer (the original task)",
            FAMILIES,
            lambda p: RESPONSE_FORMAT.format(answer=p.answer),
            max_new_tokens=32,
            max_positions=64,
        ),
        EmbeddedTask(
            "worked",
            "[10, 199] +/- 1-digit with a digit-by-digit worked solution; families by carry/borrow",
            WORKED_FAMILIES,
            lambda p: fact_drill(p.problem) if p.family in WORKED_DRILLS else worked_solution(p.problem),
            max_new_tokens=80,
            max_positions=96,
            # Most RL prompts need a regrouping step: the families where one model fails all n.
            prompt_mix={"add": 0.15, "add_carry": 0.35, "sub": 0.15, "sub_borrow": 0.35},
            drills=WORKED_DRILLS,
            steps=REGROUPING,
        ),
        EmbeddedTask(
            "code",
            "a one-line function spec in words -> a Python program, checked by hidden tests in the sandbox",
            CODE_TASK_FAMILIES,
            lambda p: p.answer,
            max_new_tokens=80,
            # room for a hint: the prompt with most of a peer program in it, then the response
            max_positions=192,
            prompt_mix={"lin": 0.05, "mod": 0.55, "cond": 0.4},
            tests=code_tests,
            steps=CODE_STEPS,
            # a hint is the first 80% of the peer's program: the restated spec and the returned
            # expression's structure, not its last characters (the plan, all but the last line,
            # would only restate the spec)
            run_config={"reward": CODE_REWARD, "hint": {"form": "prefix", "fraction": 0.8}},
        ),
    )
}

#: The task ``graftrl demo`` and ``graftrl compare`` use when ``--task`` is not given: ``worked``
#: meets the regime targets of issue 11 on the warm-started pair (docs/task_design.md).
DEFAULT_TASK = "worked"

#: ``graftrl sweep``'s default points of skill overlap (``mixes.overlap_mixes``): from the
#: task's complementary pair (0) to a pair taught the same families (1). Chosen from the GPT-2's
#: warm-start accuracy on carries (training-side, docs/reporting.md): 0.01 at 0, 0.62 at 0.33 and
#: 0.56 at 0.67, so its transition lies below 0.33 and 0.1 resolves it.
SKILL_OVERLAPS = (0.0, 0.1, 0.33, 1.0)

#: The default of the generator and warm-start functions: the task they served before tasks had
#: names, so library callers that name no task keep their problems and models.
ORIGINAL_TASK = "arith"


def get_task(name: str) -> EmbeddedTask:
    """The embedded task called ``name``; an unknown name raises KeyError listing the known ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown embedded task {name!r}; known: {', '.join(sorted(TASKS))}") from None


def _weights(
    families: Sequence[str] | Mapping[str, float] | None, known: Mapping[str, Family]
) -> tuple[list[str], list[float]]:
    if families is None:
        families = list(known)
    if isinstance(families, Mapping):
        names = [n for n, w in families.items() if w > 0]
        weights = [float(families[n]) for n in names]
    else:
        names = list(families)
        weights = [1.0] * len(names)
    if not names:
        raise ValueError("no family with a positive weight")
    for n in names:
        if n not in known:
            raise KeyError(f"unknown family {n!r}; known: {sorted(known)}")
    return names, weights


def make_problems(
    families: Sequence[str] | Mapping[str, float] | None,
    count: int,
    seed: int,
    exclude_ids: Iterable[str] = (),
    task: str = ORIGINAL_TASK,
) -> list[Problem]:
    """Generate ``count`` distinct problems, deterministically from ``seed``.

    Args:
        families: Family names (drawn uniformly) or a mapping name -> weight (drawn with those
            probabilities); ``None`` means all families, uniformly.
        count: Number of problems.
        seed: Random seed; the same arguments always give the same list.
        exclude_ids: Problem ids that must not appear (e.g. a held-out set).
        task: Name of the task whose families these are (:data:`TASKS`).

    Returns:
        A list of ``count`` problems with distinct ids, none in ``exclude_ids``.
    """
    embedded = get_task(task)
    # Drills only when named: `None` (all families) keeps each task's problem stream as it was.
    known = embedded.families if families is None else {**embedded.families, **embedded.drills}
    names, weights = _weights(families, known)
    # The arith stream predates task selection: its seed string stays as it was.
    prefix = "graftrl-embedded" if task == "arith" else f"graftrl-embedded-{task}"
    rng = random.Random(f"{prefix}:{seed}:{','.join(names)}")
    seen = set(exclude_ids)
    out: list[Problem] = []
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 100 * count + 1000:
            raise RuntimeError(f"could not generate {count} distinct problems from {names}")
        name = rng.choices(names, weights)[0]
        text, answer = known[name].generate(rng)
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
    task: str = ORIGINAL_TASK,
) -> tuple[list[Problem], list[Problem]]:
    """Disjoint RL-train and held-out evaluation sets over ``families`` (default: the task's
    prompt mix, else all families uniformly).

    The eval set is drawn first (so it does not change with ``n_train``); the train set excludes
    every eval id.
    """
    if families is None:
        families = get_task(task).prompt_mix
    eval_set = make_problems(families, n_eval, seed=seed * 1000 + 1, task=task)
    train = make_problems(
        families, n_train, seed=seed * 1000 + 2, exclude_ids={p.id for p in eval_set}, task=task
    )
    return train, eval_set


def problem_row(problem: Problem, task: str) -> dict[str, Any]:
    """One problem as the row ``load_problems`` reads: {id, problem, answer, family}, or for a task
    whose answer is a program a code row {id, problem, family, tests, entry_point,
    canonical_solution} (the program is the canonical solution, not a gold answer)."""
    tests = get_task(task).tests
    row: dict[str, Any] = {"id": problem.id, "problem": problem.problem}
    if tests is None:
        return {**row, "answer": problem.answer, "family": problem.family}
    return {
        **row,
        "family": problem.family,
        "tests": tests(problem.problem),
        "entry_point": ENTRY_POINT,
        "canonical_solution": problem.answer,
    }


def supervised_text(problem: Problem, task: str = ORIGINAL_TASK) -> str:
    """The supervised response for ``problem`` (without EOS) in ``task``'s format, e.g.
    ``"The answer is \\boxed{82}."`` (arith)."""
    return get_task(task).respond(problem)
