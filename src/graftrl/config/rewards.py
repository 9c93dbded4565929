"""The ``reward`` section: which verifier scores a response, and its settings.

``kind`` picks the verifier (``graftrl.verifiers``): ``math`` (math_verify, the default and the
paper's), ``code`` (Python programs run against the problem's tests in an OS sandbox), ``match``
(string match against one or several gold answers, or a multiple-choice letter) or ``function``
(the user's own scorer, verl's ``compute_score`` unchanged). Each kind's settings are a
sub-section; fields at their defaults stay out of a compare cell's digest, so adding a kind left
every existing cell's digest as it was.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from graftrl.core.advantages import SUCCESS_THRESHOLD
from graftrl.methods import ConfigSection

REWARD_KINDS = ("math", "code", "match", "function")
"""The verifiers ``reward.kind`` names (``graftrl.verifiers.VERIFIERS`` holds one class each)."""


class _Section(BaseModel):
    model_config = ConfigSection.model_config


class CodeRewardConfig(_Section):
    """Limits of one program's run in the sandbox (docs/verifiers.md)."""

    test_timeout_s: float = Field(default=4.0, gt=0)
    """Wall-clock budget of one test (one call of the program's function, or one stdin/stdout run);
    a test past it scores as failed (`timeout`) and the program is restarted for the next test."""
    program_timeout_s: float = Field(default=30.0, gt=0)
    """Wall-clock budget of all of one program's tests together; tests not run by then fail."""
    cpu_s: int = Field(default=10, ge=1)
    """CPU seconds of one sandboxed process (RLIMIT_CPU)."""
    memory_mb: int = Field(default=512, ge=32)
    """Address space of one sandboxed process, MiB (RLIMIT_AS); a program over it gets MemoryError."""
    processes: int = Field(default=16, ge=1)
    """Processes and threads the program may run at once (RLIMIT_NPROC of the sandbox's own user)."""
    file_mb: int = Field(default=16, ge=1)
    """Largest file the program may write in its private folder, and that folder's size, MiB."""
    output_kb: int = Field(default=256, ge=1)
    """Output of one run that is read (stdin/stdout tests); a program printing more fails that test."""
    max_tests: int = Field(default=64, ge=1)
    """Tests of a problem that are run (the first ones); the reward is the fraction of those passed."""
    partial_credit: bool = True
    """The reward of a program that fails some tests: the fraction it passed (`true`), or 0 (`false`:
    all tests or nothing, the 0/1 reward of most code RLVR recipes). A success is every test passed
    either way; the verdict's reason still says how many passed."""
    fork_server: bool = True
    """Assert-style tests run in long-lived sandboxes, a program sandbox and a judge sandbox per
    worker, whose fork server forks a fresh child per program (fresh /tmp and IPC, the limits, the
    sandbox's own user; every process of that user killed after each program): ~5x the programs
    per second. `false`: two new sandboxes per program. Needs `reward.sandbox: bwrap` and graftrl
    running as root, else it is off (docs/verifiers.md)."""
    python: str | None = None
    """Interpreter the programs run with (its prefix is mounted read-only); None: the base
    interpreter of graftrl's own Python (`sys.base_prefix`, not the virtualenv)."""


class MatchRewardConfig(_Section):
    """How a response's answer is compared with the gold answers."""

    mode: Literal["normalized", "exact", "choice"] = "normalized"
    """`exact`: the answer equals a gold string; `normalized`: equal after case-folding, collapsing
    white space and dropping surrounding punctuation and quotes; `choice`: the answer's
    multiple-choice letter (A-Z) equals the gold letter."""
    extract: Literal["last_box", "last_line", "answer_tag", "whole"] = "last_box"
    """What of a response is the answer: the last `\\boxed{}`, the last non-empty line, the text
    after the last "Answer:" (or inside the last <answer></answer>), or the whole response."""


class FunctionRewardConfig(_Section):
    """The user's own scorer."""

    path: str | None = None
    """`path/to/score.py:compute_score` or `package.module:function`. verl's signature
    `compute_score(data_source, solution_str, ground_truth, extra_info)` is detected and called
    unchanged; otherwise `fn(response, answer, row)`. It may return a bool, a number, or a dict with
    `score` (verl's form)."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Budget of one scorer call; past it the response scores 0 and the worker is replaced."""


class RewardConfig(_Section):
    kind: Literal["math", "code", "match", "function"] = "math"
    """Verifier: `math` (math_verify), `code` (Python programs against the row's tests, in an OS
    sandbox), `match` (string or multiple-choice match) or `function` (your scorer,
    `reward.function.path`); docs/verifiers.md."""
    success_threshold: float = SUCCESS_THRESHOLD
    """A response counts as a success (GRAFT's k of eq. 4, all-fail, all-pass, complementarity, the
    probe's figures, pass@k) when its reward is at least this; advantages use the reward itself."""
    timeout_s: float = Field(default=5.0, gt=0)
    """Per-answer verification timeout; a timeout scores 0."""
    deadline_s: float | None = Field(default=600.0, gt=0)
    """Overall deadline of one verifier call (a policy's answers at a step; worker start-up not
    charged): answers not verified by then score 0 and are counted in `verifier_timeouts`, so a
    flood of hanging answers cannot stall a step. None = no overall deadline."""
    workers: int = Field(default=1, ge=1)
    """Verifier worker processes (`code`: programs run in parallel, one sandbox each)."""
    extraction: Literal["last_box", "math_verify"] = "last_box"
    """What of a response is compared with the gold: `last_box` (the content of the last
    `\\boxed{}`/`\\fbox{}`, as verl's DAPO scorer; no box or a truncated last box scores 0) or
    `math_verify` (math_verify's own extraction over the whole response: every box, then "final
    answer is" lines, then the last LaTeX/number; see docs/robustness.md)."""
    sandbox: Literal["bwrap", "none"] = "bwrap"
    """`code`: run each program in a bubblewrap sandbox (own network, process and mount namespaces,
    no host files, no environment, resource limits). `none` runs programs as plain child
    processes without isolation, with a warning on every run: only for code you trust."""
    code: CodeRewardConfig = CodeRewardConfig()
    """`code` verifier limits."""
    match: MatchRewardConfig = MatchRewardConfig()
    """`match` verifier settings."""
    function: FunctionRewardConfig = FunctionRewardConfig()
    """`function` verifier settings."""

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        if self.kind == "function" and not self.function.path:
            raise ValueError(
                "reward.function.path: reward.kind is 'function' but no scorer is named; set "
                "reward.function.path to 'path/to/score.py:compute_score' or 'package.module:function'"
            )
        return self
