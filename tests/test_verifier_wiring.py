"""The run's verifier (``reward.kind``, ``graftrl.verifiers``) wherever a reward is used: built and
started before any model loads (train, probe, eval), each response scored with its problem row,
rows a verifier cannot use refused in one line naming the file, row and field, success counted
at ``reward.success_threshold`` in evaluation, and compare's digests covering the scorer's file."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pytest
import yaml
from conftest import FIXTURES, make_config
from test_compare_base import one_error_line
from typer.testing import CliRunner

from graftrl.cli import app
from graftrl.config import RewardConfig, config_from_dict
from graftrl.evaluation.benchmarks import Benchmark, load_benchmarks
from graftrl.evaluation.evaluate import EvalProtocol, default_prompt_suffix, sample_correctness
from graftrl.experiments.cells import _cell_digest, _warm_start_config, _warm_start_digest, cell_config
from graftrl.experiments.compare.task import CompareTask, Evaluation
from graftrl.experiments.matrix import Variant
from graftrl.models.rewards import MathVerifier
from graftrl.storage.data import DataError, Problem, load_problems
from graftrl.verifiers import registry
from graftrl.verifiers.base import Verdict, VerifierBase, VerifierError
from graftrl.verifiers.math import MathRewards

SMALL = FIXTURES / "math_small.jsonl"


class Recorder(VerifierBase):
    """A verifier of another kind: reward 1 when the response holds the row's ``extra['key']``;
    it records its calls and can refuse to start or refuse rows."""

    kind = "match"
    events: ClassVar[list[str]] = []
    refuse_start = False
    refuse_rows = False

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    @classmethod
    def from_config(cls, reward) -> Recorder:
        cls.events.append("built")
        return cls()

    def verify(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[Verdict]:
        self.problems += problems
        return [Verdict.correct() if "1" in r else Verdict.failed("wrong", "no 1") for r in responses]

    def check_problem(self, problem: Problem) -> str | None:
        return "field 'tests' is missing (reward.kind 'match' test)" if self.refuse_rows else None

    def start(self) -> None:
        Recorder.events.append("started")
        if self.refuse_start:
            raise VerifierError("reward.sandbox: the sandbox cannot start here; set reward.sandbox: none")

    def close(self) -> None:
        Recorder.events.append("closed")


@pytest.fixture
def recorder(monkeypatch):
    """``reward.kind: match`` builds a ``Recorder`` (the registry's import of the kind's module)."""
    Recorder.events = []
    monkeypatch.setattr(Recorder, "refuse_start", False)
    monkeypatch.setattr(Recorder, "refuse_rows", False)
    real = registry.verifier_class
    monkeypatch.setattr(registry, "verifier_class", lambda kind: Recorder if kind == "match" else real(kind))
    return Recorder


# ----- the interface of before ----------------------------------------------------------------


def test_a_scorer_of_before_is_taken_as_math_rewards():
    class Fixed:
        def score(self, responses, answers):
            return [float(a == "4") for a in answers]

    wrapped = registry.as_verifier(Fixed())
    assert isinstance(wrapped, MathRewards)
    rows = [Problem("a", "2+2", "4"), Problem("b", "2+3", "5")]
    assert wrapped.rewards(["x", "y"], rows) == [1.0, 0.0]
    assert wrapped.stats() == {} and wrapped.num_workers is None  # it has neither
    wrapped.start(), wrapped.close()  # nor these: nothing to do
    verifier = MathVerifier(timeout_s=3.0, workers=2)
    assert registry.as_verifier(verifier).timeout_s == 3.0 and registry.as_verifier(verifier).num_workers == 2
    native = Recorder()
    assert registry.as_verifier(native) is native and registry.as_verifier(None) is None
    with pytest.raises(TypeError, match="is not a verifier"):
        registry.as_verifier(object())


def test_start_verifier_starts_every_kind_but_math_and_closes_one_that_fails(recorder):
    math = MathRewards(MathVerifier())
    assert registry.start_verifier(math, "math") is math and math.verifier.worker_pids == []  # lazily
    assert isinstance(registry.build_verifier(RewardConfig()), MathRewards)  # the default kind
    recorder.refuse_start = True
    with pytest.raises(VerifierError, match=r"reward\.sandbox"):
        registry.start_verifier(Recorder(), "match")
    assert recorder.events == ["started", "closed"]


# ----- data rows ------------------------------------------------------------------------------


def test_a_row_the_verifier_cannot_use_is_refused_naming_the_file_and_row(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"problem": "1+1", "answer": "2"}\n\n{"problem": "2+2", "answer": "4", "id": "b"}\n')

    def check(problem: Problem) -> str | None:
        return "field 'tests' is missing" if problem.id == "b" else None

    assert len(load_problems(path)) == 2  # no check: as before
    with pytest.raises(DataError, match=r"rows\.jsonl line 3: field 'tests' is missing$"):
        load_problems(path, check=check)
    with pytest.raises(DataError, match=r"rows\.jsonl line 3: field 'tests' is missing$"):
        load_benchmarks([f"b={path}"], check=check)


def test_train_refuses_a_row_and_a_verifier_that_cannot_start_in_one_line(
    recorder, tiny_checkpoints, tmp_path
):
    raw = make_config(tiny_checkpoints, method="grpo")
    raw["reward"] = {"kind": "match"}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    recorder.refuse_rows = True
    result = CliRunner().invoke(app, ["train", str(config), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert one_error_line(result.output).endswith(
        "math_small.jsonl line 1: field 'tests' is missing (reward.kind 'match' test)"
    )
    recorder.refuse_rows, recorder.refuse_start = False, True
    result = CliRunner().invoke(app, ["train", str(config), "--out", str(tmp_path / "run2")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "reward.sandbox: none" in one_error_line(result.output)
    assert recorder.events[-2:] == ["started", "closed"]


def test_the_trainer_starts_its_verifier_before_any_model_loads_and_scores_with_the_rows(
    recorder, tiny_checkpoints, tmp_path, monkeypatch
):
    from graftrl.training import trainer as trainer_module

    raw = make_config(tiny_checkpoints, method="grpo", steps=1)
    raw["reward"] = {"kind": "match"}
    config = config_from_dict(raw)
    make_backend = trainer_module.make_backend

    def backend_after_the_start(setup):
        assert Recorder.events == ["built", "started"]  # before any weights load
        return make_backend(setup)

    monkeypatch.setattr(trainer_module, "make_backend", backend_after_the_start)
    trainer = trainer_module.Trainer(config, tmp_path / "run")
    verifier = trainer.verifier
    trainer.train()
    assert Recorder.events == ["built", "started", "closed"]  # one verifier, the run's, closed at the end
    by_id = {p.id: p for p in load_problems(SMALL)}
    assert verifier.problems and all(by_id[p.id] == p for p in verifier.problems)
    assert len(verifier.problems) == 2 * 4 * 4  # two policies, 4 prompts x n = 4 each


# ----- evaluation -----------------------------------------------------------------------------


class Engine:
    """A rollout engine that writes a fixed response per prompt (the problem's text)."""

    max_batch_size = 64

    def reseed(self, seed: int) -> None:
        pass

    def generate(self, policy, prompts, params):
        from types import SimpleNamespace

        return SimpleNamespace(texts=[p for p in prompts for _ in range(params.n)])


class Fraction(VerifierBase):
    """Rewards from the row: ``extra['reward']`` (a fraction of tests passed, say)."""

    kind = "code"

    def verify(self, responses, problems):
        return [Verdict(float(p.extra["reward"]), "given") for p in problems]


def test_evaluation_scores_with_the_rows_and_counts_successes_at_the_threshold():
    rows = [Problem(f"p{i}", f"q{i}", extra={"reward": r}) for i, r in enumerate((1.0, 0.5, 0.0))]
    protocol = EvalProtocol(samples=2)
    assert sample_correctness(None, rows, Fraction(), protocol, 0, Engine()) == [[1, 1], [0, 0], [0, 0]]
    half = EvalProtocol(samples=2, success_threshold=0.5)
    assert sample_correctness(None, rows, Fraction(), half, 0, Engine()) == [[1, 1], [1, 1], [0, 0]]


def test_evaluation_takes_the_runs_prompt_suffix_none_for_a_verifier_other_than_math(tiny_checkpoints):
    from graftrl.storage.data import PAPER_PROMPT_SUFFIX

    raw = make_config(tiny_checkpoints)
    del raw["data"]["prompt_suffix"]
    assert default_prompt_suffix(config_from_dict(raw)) == PAPER_PROMPT_SUFFIX
    assert default_prompt_suffix(config_from_dict({**raw, "reward": {"kind": "match"}})) is None
    assert default_prompt_suffix(None) == PAPER_PROMPT_SUFFIX  # a bare checkpoint: math


def test_eval_refuses_a_benchmark_row_and_a_verifier_that_cannot_start_in_one_line(
    tiny_checkpoints, tmp_path, monkeypatch
):
    class Refusing(MathRewards):
        refuse_rows = True

        def check_problem(self, problem):
            return "field 'answer' is not a number (test)" if self.refuse_rows else None

        def start(self):
            raise VerifierError("reward.kind: this verifier cannot start (test)")

    monkeypatch.setattr(registry, "verifier_class", lambda kind: Refusing)
    args = ["eval", str(tiny_checkpoints["llama"]), "-b", f"small={SMALL}", "--max-new-tokens", "8"]
    args += ["--out", str(tmp_path / "e")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert one_error_line(result.output).endswith(
        "math_small.jsonl line 1: field 'answer' is not a number (test)"
    )
    monkeypatch.setattr(Refusing, "refuse_rows", False)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "cannot start (test)" in one_error_line(result.output)


def test_compare_checks_its_benchmark_rows_with_the_verifier(recorder, tiny_checkpoints, tmp_path):
    from graftrl.experiments.compare.task import base_task

    raw = make_config(tiny_checkpoints)
    raw["reward"] = {"kind": "match"}
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(raw))
    recorder.refuse_rows = True
    with pytest.raises(DataError, match=r"math_small\.jsonl line 1: field 'tests' is missing"):
        base_task(path, benches=[f"b={SMALL}"])
    assert recorder.events == ["built", "closed"]  # built to check, never started


# ----- compare's digests ----------------------------------------------------------------------


def _task(base: dict) -> CompareTask:
    provenance = {"models": {"llama": {"weights_sha256": "a" * 64}, "gpt2": {"weights_sha256": "b" * 64}}}
    problems = load_problems(SMALL)[:3]
    return CompareTask("pin", base, Evaluation((Benchmark("b", problems, "b.jsonl"),), 2, True), provenance)


def _base() -> dict:
    return {
        "policies": [
            {"name": "llama", "path": "models/llama", "template": "{problem}="},
            {"name": "gpt2", "path": "models/gpt2", "template": "Q: {problem}\nA: "},
        ],
        "data": {"train": str(SMALL)},
        "rollout": {"n": 4, "max_new_tokens": 8},
        "train": {"steps": 2, "batch_prompts": 4, "minibatch_prompts": 2},
        "reward": {"workers": 2},
    }


def test_a_math_cells_digests_are_those_of_before_verifiers():
    """Pinned from the code before ``reward.kind`` existed: a math cell and its warm-start keep
    their digests (committed cells are reused, not retrained)."""
    task = _task(_base())
    assert _cell_digest(task, cell_config(task, Variant("graft", "graft"), 0, None)) == "59e448806f551be2"
    assert _warm_start_digest(task, _warm_start_config(task)) == "04cea1c924d499cf"


def test_a_cells_digest_covers_the_scorer_files_content_and_not_its_place(tmp_path):
    def digests(path: str) -> tuple[str, str]:
        base = _base()
        base["reward"] = {"kind": "function", "function": {"path": path}}
        task = _task(base)
        return _cell_digest(task, cell_config(task, Variant("grpo", "grpo"), 0, None)), _warm_start_digest(
            task, _warm_start_config(task)
        )

    scorer = tmp_path / "score.py"
    scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    first = digests(f"{scorer}:compute_score")
    moved = tmp_path / "elsewhere" / "score.py"
    moved.parent.mkdir()
    moved.write_bytes(scorer.read_bytes())
    assert digests(f"{moved}:compute_score") == first  # content, not location
    assert digests(f"{scorer}:other")[0] != first[0]  # another function of the file
    scorer.write_text(scorer.read_text().replace("1.0", "0.5"))
    changed = digests(f"{scorer}:compute_score")
    assert changed[0] != first[0] and changed[1] != first[1]  # the cells and the warm-start
    assert digests("mypackage.scoring:compute_score") != first  # an import path, as written
