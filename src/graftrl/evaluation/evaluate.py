"""Evaluation with the paper's protocol (algorithm.md §4): pass@1, pass@k, R runs, reports.

Protocol: the training prompt format (the data suffix after the policy's template or chat
template), the training verifier and response length limit; ``samples`` responses per problem
(8) at temperature 0.6 / top-p 0.95; a sample is correct when its reward is a success (at or
above ``reward.success_threshold``, ``core.is_success``: the reward itself on 0/1 rewards); pass@1
is the mean correctness over samples, then over problems; the aggregate is the unweighted mean over benchmarks; each model is evaluated in R
independent runs (different sampling seeds, default 5) and reported as mean ± std over runs
(the sample standard deviation, n - 1; 0 for a single run). pass@k for every k <= samples uses
the unbiased estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k), per problem.

Outputs (``write_report``, in :mod:`graftrl.evaluation.eval_report`): ``eval.json`` (protocol, benchmarks, and per model: per benchmark and
run the per-problem, per-sample correctness, pass@1 and pass@k, their mean/std over runs, the
aggregate), ``eval.md`` (the paper's table layout: rows = models, columns = benchmarks + Avg.,
cells "mean ± std" in percent, then the aggregate pass@k table) and ``eval.png`` (bars per
benchmark with std error bars).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from graftrl.console import progress_bar, warn
from graftrl.core.advantages import SUCCESS_THRESHOLD, is_success
from graftrl.evaluation import stats
from graftrl.evaluation.eval_report import markdown_table, plot_report, verification_summary, write_report
from graftrl.evaluation.targets import EvalPlan, ModelTarget, resolve_targets
from graftrl.models.model_loading import load_tokenizer, model_context
from graftrl.models.policy import Policy
from graftrl.models.prompts import check_chat_template, check_prompts_fit
from graftrl.models.rollout import HFRolloutEngine, RolloutEngine, SamplingParams
from graftrl.storage.data import PAPER_PROMPT_SUFFIX, MathProblem
from graftrl.verifiers.base import Verifier
from graftrl.verifiers.registry import as_verifier

__all__ = [
    "EvalPlan",
    "EvalProtocol",
    "ModelTarget",
    "evaluate_pass_at_1",
    "evaluate_targets",
    "markdown_table",
    "mean_std",
    "pass_at_1_by_family",
    "pass_at_k",
    "plot_report",
    "resolve_targets",
    "sample_correctness",
    "summarize_benchmark",
    "write_report",
]


@dataclass(frozen=True)
class EvalProtocol:
    samples: int = 8
    """Samples per problem."""
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 4096
    prompt_suffix: str | None = None
    """Same suffix as training."""
    runs: int = 5
    """Independent evaluation runs (sampling seeds ``seed``, ``seed + 1``, ...); reported as mean ± std.
    ``evaluate_pass_at_1`` does one run and ignores this."""
    seed: int = 0
    """Seed of the first run."""
    success_threshold: float = SUCCESS_THRESHOLD
    """A sample is correct when its reward is at least this (the run's ``reward.success_threshold``)."""

    @property
    def seeds(self) -> list[int]:
        return [self.seed + r for r in range(self.runs)]


# --------------------------------------------------------------------------------------------
# Estimators
# --------------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_std(values: Sequence[float]) -> dict[str, Any]:
    """{"mean", "std", "runs"} of ``stats.mean_std``: sample std (n - 1), 0 for one value; mean NaN
    for no values."""
    values = [float(v) for v in values]
    if not values:
        return {"mean": float("nan"), "std": 0.0, "runs": values}
    summary = stats.mean_std(values)
    return {"mean": summary.mean, "std": summary.std, "runs": values}


def summarize_benchmark(
    correct: Sequence[Sequence[float]], threshold: float = SUCCESS_THRESHOLD
) -> dict[str, Any]:
    """One run on one benchmark: ``correct`` is [problem][sample] in {0, 1} (``sample_correctness``),
    or rewards, of which those at or above ``threshold`` count as correct (``core.is_success``).

    Returns pass_at_1 (mean over samples, then problems) and pass_at_k for k = 1..samples
    (the per-problem unbiased estimate, averaged over problems).
    """
    if not correct:
        raise ValueError("summarize_benchmark: no problems")
    n = len(correct[0])
    if any(len(row) != n for row in correct):
        raise ValueError("summarize_benchmark: every problem needs the same number of samples")
    correct = [[float(is_success(x, threshold)) for x in row] for row in correct]
    counts = [round(sum(row)) for row in correct]
    by_k = {k: statistics.fmean(pass_at_k(n, c, k) for c in counts) for k in range(1, n + 1)}
    pass_1 = statistics.fmean(statistics.fmean(row) for row in correct)
    return {"pass_at_1": pass_1, "pass_at_k": {str(k): v for k, v in by_k.items()}}


# --------------------------------------------------------------------------------------------
# Sampling and scoring
# --------------------------------------------------------------------------------------------


def _prompt(problem: str, suffix: str | None) -> str:
    return f"{problem} {suffix}" if suffix else problem


def sample_correctness(
    policy: Policy,
    problems: Sequence[MathProblem],
    verifier: Verifier,
    protocol: EvalProtocol,
    seed: int,
    engine: RolloutEngine | None = None,
    on_chunk: Callable[[int], None] | None = None,
) -> list[list[float]]:
    """Sample ``protocol.samples`` responses per problem and score them: [problem][sample] in {0, 1},
    1 where the reward is a success (at or above ``protocol.success_threshold``).

    ``verifier``: the run's (``graftrl.verifiers``; an object with the older ``score(responses,
    answers)`` is taken as math's), given each sample's problem row. Any rollout engine serving
    ``policy`` (the HF engine by default). Problems go through it in chunks of
    ``engine.max_batch_size // samples`` prompts (the HF engine's own chunking, so results do not
    depend on it), on the stream ``engine.reseed(seed)`` starts; each chunk is verified as soon as
    it is generated and ``on_chunk(number_of_problems)`` is called after it, for progress bars.
    """
    engine = engine or HFRolloutEngine()
    verifier = as_verifier(verifier)
    params = SamplingParams(protocol.samples, protocol.temperature, protocol.top_p, protocol.max_new_tokens)
    per_call = max(1, engine.max_batch_size // protocol.samples)
    engine.reseed(seed)
    out: list[list[float]] = []
    for start in range(0, len(problems), per_call):
        chunk = problems[start : start + per_call]
        batch = engine.generate(policy, [_prompt(p.problem, protocol.prompt_suffix) for p in chunk], params)
        rewards = verifier.rewards(batch.texts, [p for p in chunk for _ in range(protocol.samples)])
        for i in range(len(chunk)):
            group = rewards[i * protocol.samples : (i + 1) * protocol.samples]
            out.append([float(is_success(float(r), protocol.success_threshold)) for r in group])
        if on_chunk is not None:
            on_chunk(len(chunk))
    return out


def evaluate_pass_at_1(
    policy: Policy,
    problems: Sequence[MathProblem],
    verifier: Verifier,
    protocol: EvalProtocol = EvalProtocol(),
    seed: int = 0,
    engine: RolloutEngine | None = None,
) -> dict[str, Any]:
    """Mean correctness over samples, then over problems.

    Returns pass_at_1 and the per-problem rates, plus ``per_family`` (family -> pass@1 over its
    problems) when any problem names a family.
    """
    correct = sample_correctness(policy, problems, verifier, protocol, seed, engine)
    per_problem = [statistics.fmean(row) for row in correct]
    result: dict[str, Any] = {"pass_at_1": statistics.fmean(per_problem), "per_problem": per_problem}
    if by_family := pass_at_1_by_family(problems, per_problem):
        result["per_family"] = by_family
    return result


def pass_at_1_by_family(problems: Sequence[MathProblem], per_problem: Sequence[float]) -> dict[str, float]:
    """family -> mean per-problem pass@1 over the problems of that family (problems without one skipped)."""
    by_family: dict[str, list[float]] = {}
    for problem, rate in zip(problems, per_problem, strict=True):
        if problem.family is not None:
            by_family.setdefault(problem.family, []).append(rate)
    return {family: statistics.fmean(rates) for family, rates in sorted(by_family.items())}


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------


@dataclass
class _VerifierMeter:
    """Verification counters over a span of ``score`` calls (the verifier's stats() deltas)."""

    verifier: Any
    start: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.start = self._stats()

    def _stats(self) -> dict[str, float]:
        stats = getattr(self.verifier, "stats", None)
        return dict(stats()) if callable(stats) else {}

    def report(self) -> dict[str, Any]:
        now = self._stats()
        delta = {k: now[k] - self.start.get(k, 0) for k in now if k != "cache_entries"}
        seconds = delta.get("seconds", 0.0)
        answers = delta.get("answers", 0)
        return {
            **delta,
            "workers": getattr(self.verifier, "num_workers", None),
            "timeout_s": getattr(self.verifier, "timeout_s", None),
            "answers_per_s": answers / seconds if seconds > 0 else None,
        }


def evaluate_policy(
    policy: Policy,
    benchmarks: Sequence[Any],
    verifier: Verifier,
    protocol: EvalProtocol,
    engine: RolloutEngine | None = None,
    progress: Any = None,
    label: str | None = None,
    seeds: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Evaluate one loaded policy on every benchmark for every run; returns its report entry."""
    engine = engine or HFRolloutEngine()
    seeds = list(seeds if seeds is not None else protocol.seeds)
    label = label or policy.name
    per_bench: dict[str, dict[str, Any]] = {}
    for benchmark in benchmarks:
        runs = []
        for seed in seeds:
            task = None
            if progress is not None:
                task = progress.add_task(
                    f"{label} · {benchmark.name} · seed {seed}", total=len(benchmark.problems)
                )

            def advance(count: int, task=task) -> None:
                if progress is not None and task is not None:
                    progress.update(task, advance=count)

            correct = sample_correctness(
                policy, benchmark.problems, verifier, protocol, seed, engine, advance
            )
            if progress is not None and task is not None:
                progress.remove_task(task)
            runs.append({"seed": seed, **summarize_benchmark(correct), "correct": _compact(correct)})
        per_bench[benchmark.name] = {
            "pass_at_1": mean_std([r["pass_at_1"] for r in runs]),
            "pass_at_k": {k: mean_std([r["pass_at_k"][k] for r in runs]) for k in runs[0]["pass_at_k"]},
            "runs": runs,
        }
    return {"benchmarks": per_bench, "aggregate": _aggregate(per_bench, len(seeds))}


def _compact(correct: list[list[float]]) -> list[list[int]]:
    return [[round(x) for x in row] for row in correct]


def _aggregate(per_bench: Mapping[str, Mapping[str, Any]], runs: int) -> dict[str, Any]:
    """Unweighted mean over benchmarks within each run, then mean ± std over runs."""
    names = list(per_bench)
    agg_1 = [statistics.fmean(per_bench[b]["runs"][r]["pass_at_1"] for b in names) for r in range(runs)]
    ks = list(per_bench[names[0]]["runs"][0]["pass_at_k"]) if names else []
    agg_k = {
        k: mean_std(
            [statistics.fmean(per_bench[b]["runs"][r]["pass_at_k"][k] for b in names) for r in range(runs)]
        )
        for k in ks
    }
    return {"pass_at_1": mean_std(agg_1), "pass_at_k": agg_k}


def evaluate_targets(
    targets: Sequence[ModelTarget],
    benchmarks: Sequence[Any],
    verifier: Verifier,
    protocol: EvalProtocol,
    engine: HFRolloutEngine | None = None,
    progress: bool = True,
    console: Any = None,
) -> dict[str, Any]:
    """Evaluate every target (loaded one at a time) on every benchmark; returns the report dict.

    One engine samples every target: an engine that serves any policy (the HF engine)."""
    if not benchmarks:
        raise ValueError("evaluate_targets: no benchmarks")
    check_prompts(targets, benchmarks, protocol)  # before any model loads
    engine = engine or HFRolloutEngine()
    meter = _VerifierMeter(verifier)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "protocol": {
            **asdict(protocol),
            "seeds": protocol.seeds,
            "ks": list(range(1, protocol.samples + 1)),
            "std": "sample standard deviation over runs (n - 1); 0 for one run",
            "aggregate": "unweighted mean over benchmarks within each run",
        },
        "benchmarks": [{"name": b.name, "source": b.source, "problems": len(b.problems)} for b in benchmarks],
        "ids": {b.name: [p.id for p in b.problems] for b in benchmarks},
        "models": {},
    }
    bar = progress_bar(progress)
    try:
        overall = bar.add_task(
            "evaluation", total=len(targets) * protocol.runs * sum(len(b.problems) for b in benchmarks)
        )

        class _Both:
            """Advance the per-benchmark bar and the overall bar together."""

            def add_task(self, *args, **kwargs):
                return bar.add_task(*args, **kwargs)

            def update(self, task, advance: int) -> None:
                bar.update(task, advance=advance)
                bar.update(overall, advance=advance)

            def remove_task(self, task) -> None:
                bar.remove_task(task)

        for target in targets:
            policy = target.load()
            entry = evaluate_policy(policy, benchmarks, verifier, protocol, engine, _Both(), target.label)
            report["models"][target.label] = {
                "path": target.path,
                "policy": target.policy,
                "completed_steps": target.completed_steps,
                "template": target.template,
                "chat_template": target.chat_template,
                **entry,
            }
            del policy
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        bar.stop()
    report["verification"] = meter.report()
    report["seconds"] = time.perf_counter() - started
    if console is not None:
        console.print(verification_summary(report["verification"]))
    return report


def check_prompts(targets: Sequence[ModelTarget], benchmarks: Sequence[Any], protocol: EvalProtocol) -> None:
    """Refuse, in one line, a benchmark prompt that does not fit a target's context with the
    response budget (``--max-new-tokens``), as ``graftrl train`` refuses a training prompt: from
    the folders' tokenizers and configs, before any weights load or anything is sampled (a 5 MB
    problem would otherwise ask for gigabytes of attention)."""
    for target in targets:
        tokenizer = load_tokenizer(target.policy, target.path)
        check_chat_template(target.policy, tokenizer, target.chat_template, "--chat-template", warn)
        context = model_context(target.policy, target.path)
        for benchmark in benchmarks:
            check_prompts_fit(
                target.policy,
                tokenizer,
                context,
                target.template,
                target.chat_template,
                [(p.id, _prompt(p.problem, protocol.prompt_suffix)) for p in benchmark.problems],
                protocol.max_new_tokens,
                source=f"benchmark {benchmark.name} ({benchmark.source})",
                limit="--max-new-tokens",
                suffix=protocol.prompt_suffix,
                suffix_field="--prompt-suffix",
                template_field="--template",
            )


def default_prompt_suffix(config: Any) -> str | None:
    """The run's data suffix, or the paper's suffix for a bare checkpoint."""
    return config.data.prompt_suffix if config is not None else PAPER_PROMPT_SUFFIX
