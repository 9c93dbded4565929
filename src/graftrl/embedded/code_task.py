"""The embedded ``code`` task's problems: a one-line function spec in words, answered by a short
Python program that hidden tests check in the code verifier's sandbox (docs/task_design.md, "The
code task").

A problem is a spec such as ``"add 57 if odd else mul 9"``; its answer is the program::

    def f(x):
        # add 57 if odd else mul 9
        return x+57 if x%2 else x*9

The comment restates the spec, as a docstring would: like the ``worked`` task's restated digits,
most of a response is then copying that both models do, so the compatibility gate judges the
step a receiver lacks on a few tokens of many (docs/task_design.md, "The code task").

and its hidden tests are ``assert f(x) == <value>`` at six fixed inputs, three odd and three even
(:data:`TEST_INPUTS`). The reward is the fraction of tests passed, so a program that misses a step
gets partial credit: ``return x+57`` passes the odd inputs of the spec above (0.5).

Families (each a step on top of one shared skeleton, ``def f(x):`` and ``return``):

- ``lin``: ``add A sub C`` -> ``x+A-C`` (no step: both models learn it);
- ``mod``: ``add A mod M`` / ``sub A mod M`` -> ``(x+A)%M``: the step is the parentheses and the
  modulo (a model without it writes ``x+A%M`` or ``x+A``);
- ``cond``: ``add A if odd else mul B`` / ``mul B if odd else add A`` -> ``x+A if x%2 else x*B``:
  the step is the conditional on the parity (a model without it writes one branch).

Why a spec in words and not input/output examples: inducing constants from examples needs
multi-digit arithmetic that ~1M-parameter models do not learn within a CPU warm-start (the
arithmetic tasks needed a digit-by-digit working for that); the spec keeps the test of a program's
*structure*, which is what the two models' deficits are about.

Standard library only; the generators return ``(spec, program)`` pairs like the arithmetic ones.
"""

from __future__ import annotations

import random
import re

__all__ = [
    "CODE_FAMILIES",
    "CODE_OUTCOMES",
    "CODE_STEPS",
    "ENTRY_POINT",
    "TEST_INPUTS",
    "classify_code",
    "code_program",
    "code_tests",
    "reference_function",
]

ENTRY_POINT = "f"
"""The function every program defines (the tests call it)."""
TEST_INPUTS = (0, 1, 2, 7, 10, 15)
"""The hidden tests' inputs: three even, three odd, so a program with one branch passes half."""
_HEADER = f"def {ENTRY_POINT}(x):\n"


def _lin(rng: random.Random) -> str:
    return f"add {rng.randint(1, 99)} sub {rng.randint(1, 99)}"


def _mod(rng: random.Random) -> str:
    return f"{rng.choice(('add', 'sub'))} {rng.randint(1, 99)} mod {rng.randint(2, 9)}"


def _cond(rng: random.Random) -> str:
    add, mul = f"add {rng.randint(1, 99)}", f"mul {rng.randint(2, 9)}"
    first, second = (add, mul) if rng.random() < 0.5 else (mul, add)
    return f"{first} if odd else {second}"


CODE_FAMILIES = {
    "lin": ("add A sub C: x+A-C, A and C in [1, 99] (no step)", _lin),
    "mod": ("add/sub A mod M: (x+A)%M, A in [1, 99], M in [2, 9] (parentheses and modulo)", _mod),
    "cond": ("add A if odd else mul B (or the branches swapped), B in [2, 9] (a parity conditional)", _cond),
}
"""Family name -> (description, spec generator)."""

CODE_STEPS = ("mod", "cond")
"""The families with a step on top of the skeleton: each model's deficit is the other's step."""

_OP = {"add": "+", "sub": "-", "mul": "*"}
_TERM = r"(add|sub|mul) (\d+)"
_SPECS = (
    (re.compile(r"add (\d+) sub (\d+)"), lambda m: f"x+{m[1]}-{m[2]}"),
    (re.compile(rf"{_TERM} mod (\d+)"), lambda m: f"(x{_OP[m[1]]}{m[2]})%{m[3]}"),
    (
        re.compile(rf"{_TERM} if odd else {_TERM}"),
        lambda m: f"x{_OP[m[1]]}{m[2]} if x%2 else x{_OP[m[3]]}{m[4]}",
    ),
)


def _expression(spec: str) -> str:
    for pattern, write in _SPECS:
        match = pattern.fullmatch(spec)
        if match:
            return write(match)
    raise ValueError(f"not a code-task spec: {spec!r}")


def code_program(spec: str) -> str:
    """The canonical program of ``spec`` (the supervised response, without EOS)::

    "add 3 mod 5" -> "def f(x):\\n    # add 3 mod 5\\n    return (x+3)%5"
    """
    return f"{_HEADER}    # {spec}\n    return {_expression(spec)}"


def reference_function(spec: str):
    """The spec as a Python function (the tests' expected values; evaluates graftrl's own
    expression, never a model's)."""
    expression = _expression(spec)
    return lambda x: eval(expression, {"__builtins__": {}}, {"x": x})


def code_tests(spec: str) -> list[str]:
    """The hidden tests of ``spec``: ``assert f(x) == value`` at each of :data:`TEST_INPUTS`."""
    reference = reference_function(spec)
    return [f"assert {ENTRY_POINT}({x}) == {reference(x)}" for x in TEST_INPUTS]


#: What a code-task response got wrong (``classify_code``): ``correct``; ``step`` the family's step
#: missing or wrong (the program's structure is not the spec's: no modulo or parentheses, no
#: conditional, branches swapped); ``constant`` the structure right but a number wrong; ``format``
#: not a ``def f(x): # comment; return ...`` program of this task at all (the comment is not
#: checked: only the returned expression is).
CODE_OUTCOMES = ("correct", "step", "constant", "format")

_RESPONSE = re.compile(r"def f\(x\):\n    # (.*)\n    return (.+)")


def _shape(expression: str) -> str:
    return re.sub(r"\d+", "N", expression.replace(" ", ""))


def classify_code(spec: str, response: str) -> str:
    """Which part of the canonical program a response misses (:data:`CODE_OUTCOMES`), by text: a
    program that differs from the canonical one only in its numbers is a ``constant`` error, one
    whose shape differs a ``step`` error. Text, not behaviour: the verifier's reward is the
    behaviour; this is the diagnostic of where a policy goes wrong."""
    match = _RESPONSE.fullmatch(response.strip("\n"))
    if match is None:
        return "format"
    got, want = match[2].strip(), _expression(spec)
    if got == want:
        return "correct"
    return "constant" if _shape(got) == _shape(want) else "step"
