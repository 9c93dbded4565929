"""`graftrl probe CONFIG`: a pair's exchange regime before any update, for the cost of a rollout.

Runs ``graftrl.experiments.probe_steps`` (training steps up to the update, on the config's training
prompts, with its engine and backend), writes every sample as it goes and then the figures
(``probe_stats``) as probe.json, probe.md and plots (``probe_report``). The folder
(``storage.rundir.ProbeDir``)::

    samples.jsonl        every sampled response: step, model, prompt_id, index, reward,
                         advantage, tokens (sampled, EOS included), finished, response
    candidates.jsonl     every response of every candidate peer group, scored on its receiver
                         with GRAFT's rule: step, receiver, source, prompt_id, index, reward,
                         advantage, s, w, admitted (w > 0), selected (the method's plan moves it)
    compatibility.jsonl  the method's own exchange, as a training run logs it
    moved_groups.jsonl   each peer group the method's plan moves: receiver, source, prompt_id,
                         responses it trains on, its contrast sums (``core.contrast``)
    steps.jsonl          one row per (step, policy): a training step's metrics less the update's,
                         the phases' seconds (``wall_*`` for the step) and token counts

``reporting.probe_stats.recount(folder)`` recomputes every figure of probe.json from these files.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from graftrl.config import Config
from graftrl.console import progress_bar
from graftrl.core.advantages import is_success
from graftrl.experiments.probe_steps import Probe, ProbeStep, probe_batches, probe_config
from graftrl.files import atomic_write
from graftrl.methods import ExchangePlan
from graftrl.models.policy import Policy
from graftrl.reporting.probe_stats import (
    RESCUE_KEYS,
    ProbeError,
    ProbeSettings,
    StepData,
    probe_statistics,
    with_served,
)
from graftrl.storage.data import MathProblem, load_problems
from graftrl.storage.rundir import ProbeDir, RunDir, append_jsonl
from graftrl.training.rows import CompatibilityScores
from graftrl.verifiers.registry import build_verifier


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    folder: ProbeDir
    figures: dict[str, Any]
    plots: list[Path]


def settings_of(config: Config, config_path: str, prompts: int, notes: list[str]) -> ProbeSettings:
    policies = [p.name for p in config.policies]
    return ProbeSettings(
        config=config_path,
        method=config.method,
        seed=config.seed,
        prompts=prompts,
        batch_prompts=config.train.batch_prompts,
        n=config.rollout.n,
        delta=config.graft.delta,
        policies=policies,
        models=policies + [p.name for p in config.peers if not p.served],  # served: all-fail prompts only
        backend=config.backend,
        engine=config.rollout.engine,
        update_epochs=config.train.update_epochs,
        reference_forward=config.train.kl_coef > 0,
        notes=notes,
        success_threshold=config.reward.success_threshold,
    )


def check_out_folder(folder: Path) -> None:
    """Refuse, before any model loads, a folder that holds a training run or cannot be written."""
    if RunDir(folder).holds_run():
        raise ProbeError(
            f"--out {folder}: holds a training run (metrics.jsonl), whose logs the probe would "
            "overwrite; give the probe its own folder"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ProbeError(
            f"--out {folder}: cannot write there ({error.strerror or error}); choose a writable folder"
        ) from None


# ----- from the trainer's objects ----------------------------------------------------------------


def _peer_indices(plan: ExchangePlan, n: int) -> list[tuple[int, int]]:
    """(group, response) of each scored peer row, in the order build_rows scores them."""
    return [
        (g, i)
        for g, group in enumerate(plan.groups)
        if group.peer and not group.nll
        for i in range(n)
        if group.keep is None or bool(group.keep[i])
    ]


def _compat_row(scores: CompatibilityScores) -> dict[str, Any]:
    """A CompatibilityScores as the trainer writes it to compatibility.jsonl."""
    return {k: v for k, v in dataclasses.asdict(scores).items() if v is not None}


def step_data(result: ProbeStep, n: int) -> tuple[StepData, dict[str, list[dict[str, Any]]]]:
    """The step as the statistics read it, and the rows of each file (by ProbeDir name)."""
    ex, step = result.exchange, result.step
    ids = [p.id for p in ex.problems]
    samples = [
        {
            "step": step,
            "model": model,
            "sampled": model in ex.sampled,
            "prompt_id": r.prompt_id,
            "index": r.index,
            "reward": r.reward,
            "advantage": r.advantage,
            "tokens": r.num_tokens + int(r.finished) if model in ex.sampled else 0,
            "finished": r.finished,
            "response": r.response,
        }
        for model, records in ex.records.items()
        for p, r in enumerate(records)
        if model not in ex.served_prompts or p // n in ex.served_prompts[model]  # no placeholders
    ]
    candidates, compatibility, moved_groups = [], [], []
    for receiver, c in result.candidates.items():
        plan, moved_plan = result.candidate_plans[receiver], ex.plans[receiver]
        selected = {(g.source, g.prompt) for g in moved_plan.peer_groups}
        if c is not None:
            for k, (g, i) in enumerate(_peer_indices(plan, n)):
                group = plan.groups[g]
                candidates.append(
                    {
                        "step": step,
                        "receiver": receiver,
                        "source": c.source[k],
                        "prompt_id": c.prompt_id[k],
                        "index": i,
                        "reward": c.reward[k],
                        "advantage": c.advantage[k],
                        "s": c.s[k],
                        "w": c.w[k],
                        "admitted": c.admitted[k],
                        "selected": (group.source, group.prompt) in selected,
                    }
                )
        moved = result.moved[receiver]
        if moved.compatibility is not None:
            compatibility.append(_compat_row(moved.compatibility))
        for g, group in enumerate(moved_plan.groups):
            if group.peer:
                contrast = moved.group_contrasts.get(g)
                moved_groups.append(
                    {
                        "step": step,
                        "receiver": receiver,
                        "source": group.source,
                        "prompt_id": ids[group.prompt],
                        "responses": n if group.keep is None else int(group.keep.sum()),
                        "nll": group.nll,
                        "contrast": dataclasses.asdict(contrast) if contrast is not None else None,
                    }
                )
    costs = {
        name: {
            "time_rollout": ex.sampled[name].timings.get("time_rollout", 0.0),
            "time_reward": ex.sampled[name].timings.get("time_reward", 0.0),
            "time_peer_logprob": result.moved[name].metrics.get("time_peer_logprob", 0.0),
            "candidates_time_peer_logprob": result.candidate_pass[name].metrics.get("time_peer_logprob", 0.0),
            "scored_tokens": result.moved[name].scored_tokens + result.candidate_pass[name].scored_tokens,
            "update_tokens": result.moved[name].row_tokens,
        }
        for name in ex.sampled
    }
    wall = {f"wall_{k}": v for k, v in result.seconds.items()}
    steps = [
        {"step": step, "model": name, "prompts": len(ids), **result.metrics[name], **costs[name], **wall}
        for name in ex.sampled
    ]
    data = StepData(
        step=step,
        prompt_ids=ids,
        rewards={model: outcome.rewards for model, outcome in ex.shared.items()},
        tokens={name: sum(r["tokens"] for r in samples if r["model"] == name) for name in ex.sampled},
        candidates=candidates,
        compatibility=compatibility,
        moved_groups=moved_groups,
        costs=costs,
        wall=wall,
        rescue={
            name: {k: result.metrics[name][k] for k in RESCUE_KEYS}
            for name in ex.sampled
            if "rescue_attempted" in result.metrics[name]
        },
    )
    rows = {
        "samples": samples,
        "candidates": candidates,
        "compatibility": compatibility,
        "moved_groups": moved_groups,
        "steps": steps,
    }
    return data, rows


# ----- the command -------------------------------------------------------------------------------


def _training_rows(config: Config) -> list[MathProblem]:
    """The training rows, each checked by the run's verifier (one line naming the file, row and
    field). The trainer builds and starts the run's own verifier (before any model loads); this one
    only checks, so a caller's verifier is never sent to rank processes or Ray actors."""
    checker = build_verifier(config.reward)
    try:
        return load_problems(config.data.train, check=checker.check_problem)
    finally:
        checker.close()


def run_probe(
    config: Config,
    out: str | Path,
    prompts: int,
    *,
    config_path: str = "<config>",
    problems: Sequence[MathProblem] | None = None,
    policies: Sequence[Policy] | None = None,
    verifier: Any = None,
    progress: bool = True,
    on_checked: Callable[[], None] | None = None,
) -> ProbeResult:
    """Probe ``config`` on ``prompts`` of its training prompts and write the folder ``out``.

    Everything the user can get wrong is refused before a model loads: the data, ``prompts``,
    the folder; ``on_checked`` is called once they have passed (the CLI's notes)."""
    from graftrl.reporting.probe_report import write_report

    config, notes = probe_config(config)
    if problems is None:
        problems = _training_rows(config)
    batches = probe_batches(problems, config, prompts)
    folder = ProbeDir(out)
    check_out_folder(folder.root)
    if on_checked is not None:
        on_checked()
    for path in (*folder.logs, folder.json, folder.report, *folder.plots()):
        path.unlink(missing_ok=True)  # an earlier probe's: this one's samples start empty
    settings = settings_of(config, config_path, prompts, notes)
    probe = Probe(config, folder.root, problems=problems, policies=policies, verifier=verifier)
    steps: list[StepData] = []
    step_rows: list[dict[str, Any]] = []
    bar = progress_bar(progress, status=True)
    try:
        task = bar.add_task(f"probe {config.method}", total=len(batches), status="")
        for step, batch in enumerate(batches):
            data, rows = step_data(probe.step(step, batch), config.rollout.n)
            for name, lines in rows.items():
                append_jsonl(getattr(folder, name), lines)
            step_rows += rows["steps"]
            steps.append(data)
            status = "  ".join(
                f"{m} acc={float(is_success(data.rewards[m], settings.success_threshold).float().mean()):.2f}"
                for m in settings.policies
            )
            bar.update(task, advance=1, status=status)
    finally:
        bar.stop()
        probe.close()
    figures = with_served(probe_statistics(settings, steps), step_rows)
    atomic_write(folder.json, (json.dumps(figures, indent=2) + "\n").encode())
    plots = write_report(folder, figures, steps)
    return ProbeResult(folder, figures, plots)
