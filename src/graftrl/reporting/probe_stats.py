"""The figures of `graftrl probe` (probe.json), from its steps in one form, ``StepData``.

``probe_statistics`` is the one computation of every figure. The probe hands it ``StepData``
built from the trainer's objects (``experiments.probe.step_data``); the recount (``recount``) hands it
``StepData`` rebuilt from the files the probe wrote (``read_steps``), so that every figure can be recounted
from the samples. The regime's own computations are graftrl's: candidates (eq. 4,
``core.transfer_candidates``), the gate by outcome and the moved groups' advantage mass
(``reporting.diagnostics``), the contrast (``core.contrast`` sums, pooled over steps by
``reporting.contrast.contrast_summary``, as ``analyze`` and ``compare`` pool them).
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from graftrl.core import transfer_candidates
from graftrl.core.advantages import SUCCESS_THRESHOLD, is_success
from graftrl.core.contrast import GroupContrast, contrast_metrics
from graftrl.errors import UserError
from graftrl.reporting.contrast import contrast_summary
from graftrl.reporting.diagnostics import advantage_mass, gate_by_outcome
from graftrl.reporting.probe_rule import verdicts
from graftrl.reporting.served import served_costs
from graftrl.reporting.weights import WeightRule
from graftrl.storage.rundir import ProbeDir, read_jsonl


class ProbeError(UserError):
    """A probe that cannot run as asked, or a folder it cannot recount (the option or file named,
    and the fix)."""


QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
"""The quantiles of s reported per outcome (nearest rank, as scripts/probe_task.py prints them)."""
UPDATE_FORWARDS = 3
"""An update costs about three forward passes per token (the backward about two), so the update
estimate is 3 x the forward time per token of the probe's own no-grad scoring passes (plus one
forward of the frozen reference with ``train.kl_coef`` > 0) x the tokens the update would train."""
COST_KEYS = (
    "time_rollout",
    "time_reward",
    "time_peer_logprob",
    "candidates_time_peer_logprob",
    "scored_tokens",
    "update_tokens",
)
"""Per (step, policy) in steps.jsonl: the phases' seconds (``time_peer_logprob``: the scoring pass
of the method's rows; ``candidates_``: of the other candidate groups), the prompt + response
tokens of both scoring passes and of the rows the update would train."""
RESCUE_KEYS = ("rescue_attempted", "rescue_solved")
"""Per (step, policy) in steps.jsonl under a method with a rescue round (``hint``): its all-fail
prompts sampled again with a peer's hint, and of them those solved at least once."""
WALL_KEYS = ("wall_rollout", "wall_moved", "wall_candidates")
"""Per step in steps.jsonl: wall-clock of sampling + planning, of building the method's rows and
of scoring the other candidate groups."""


@dataclass(frozen=True)
class ProbeSettings:
    """What the probe ran: the config's figures the statistics and the report need."""

    config: str
    method: str
    seed: int
    prompts: int
    batch_prompts: int
    n: int
    delta: float
    policies: list[str]
    """The receivers (the config's policies)."""
    models: list[str]
    """Every source: the policies, then stored peers."""
    backend: str
    engine: str
    update_epochs: int = 1
    reference_forward: bool = False
    """``train.kl_coef`` > 0: the update also runs the frozen reference forward."""
    notes: list[str] = field(default_factory=list)
    success_threshold: float = SUCCESS_THRESHOLD
    """``reward.success_threshold``: the rewards the figures count as successes (correct); a
    probe.json written before it was recorded counted 0/1 rewards, the default's successes."""


@dataclass
class StepData:
    """One probe step, as the statistics read it."""

    step: int
    prompt_ids: list[str]
    rewards: dict[str, Tensor]
    """Model -> [P, n] rewards on the step's prompts (policies and stored peers)."""
    tokens: dict[str, int]
    """Policy -> tokens it sampled (EOS included)."""
    candidates: list[dict[str, Any]]
    """Every scored response of every candidate peer group (candidates.jsonl rows)."""
    compatibility: list[dict[str, Any]]
    """The method's exchange per receiver (compatibility.jsonl rows)."""
    moved_groups: list[dict[str, Any]]
    """Each peer group of the method's plan (moved_groups.jsonl rows)."""
    costs: dict[str, dict[str, float]]
    """Policy -> ``COST_KEYS``."""
    wall: dict[str, float]
    """``WALL_KEYS`` -> seconds."""
    rescue: dict[str, dict[str, float]] = field(default_factory=dict)
    """Policy -> ``RESCUE_KEYS`` of its rescue round (a method that ``rescues``; else empty)."""


def nearest_rank(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _share(count: int, total: int) -> float | None:
    return count / total if total else None


def _direction(source: str, receiver: str) -> str:
    return f"{source} -> {receiver}"


def _only(rows: Iterable[Mapping[str, Any]], source: str) -> list[dict[str, Any]]:
    """compatibility.jsonl rows cut to the entries of one source (their list fields filtered)."""
    out = []
    for row in rows:
        keep = [i for i, s in enumerate(row["source"]) if s == source]
        if keep:
            out.append(
                {
                    key: [value[i] for i in keep] if isinstance(value, list) else value
                    for key, value in row.items()
                }
            )
    return out


def _scores(
    rows: Sequence[Mapping[str, Any]], delta: float, threshold: float = SUCCESS_THRESHOLD
) -> dict[str, Any]:
    """Scored responses of one direction: the gate at delta (s > delta) and the admitted ones
    (w > 0) by outcome (``diagnostics.gate_by_outcome``; correct: a reward at or above
    ``threshold``), with the quantiles of s."""
    if not rows:
        return {"responses": 0}
    record = {
        "receiver": rows[0]["receiver"],
        "s": [r["s"] for r in rows],
        "reward": [r["reward"] for r in rows],
        "w": [r["w"] for r in rows],
    }
    gates = gate_by_outcome([record], delta, threshold=threshold)[record["receiver"]]
    out: dict[str, Any] = {
        "responses": len(rows),
        "passed": sum(g.passed for g in gates.values()),
        "admitted": sum(g.admitted or 0 for g in gates.values()),
    }
    out["passed_share"] = _share(out["passed"], len(rows))
    out["admitted_share"] = _share(out["admitted"], len(rows))
    for outcome, gate in gates.items():
        values = [r["s"] for r in rows if is_success(r["reward"], threshold) == (outcome == "correct")]
        out[outcome] = {
            "responses": gate.responses,
            "passed": gate.passed,
            "passed_share": gate.passed_share,
            "admitted": gate.admitted,
            "median_s": gate.median_s,
            "quantiles": {f"p{round(100 * q)}": nearest_rank(values, q) for q in QUANTILES}
            if values
            else None,
        }
    return out


def _moved(steps: Sequence[StepData], source: str, receiver: str, settings: ProbeSettings) -> dict[str, Any]:
    """What the method's plan moves from source to receiver: groups, responses, admissions,
    the advantage mass per moved group and the contrast (pooled over steps)."""
    label = _direction(source, receiver)
    groups = [g for s in steps for g in s.moved_groups if g["source"] == source and g["receiver"] == receiver]
    scores = _only((r for s in steps for r in s.compatibility if r["receiver"] == receiver), source)
    out: dict[str, Any] = {
        "groups": len(groups),
        "responses": sum(g["responses"] for g in groups),
        "scored": sum(len(r["s"]) for r in scores),
        "admitted": sum(sum(bool(a) for a in r.get("admitted") or []) for r in scores),
    }
    rule = WeightRule(settings.method, delta=settings.delta)
    mass = advantage_mass(scores, settings.n, rule, threshold=settings.success_threshold)
    entry = mass.get(receiver) if mass else None
    out["mass"] = (
        {"groups": entry.groups, "correct": entry.correct, "wrong": entry.wrong, "net": entry.net}
        if entry
        else None
    )
    per_step = []
    for s in steps:
        total = GroupContrast()
        for g in s.moved_groups:
            if g["source"] == source and g["receiver"] == receiver and g["contrast"] is not None:
                total += GroupContrast(**g["contrast"])
        per_step.append({"model": label, **contrast_metrics(total)})
    out["contrast"] = contrast_summary(per_step).get(label)
    return out


def _cost(steps: Sequence[StepData], settings: ProbeSettings) -> dict[str, Any]:
    """Tokens and seconds of the probe, and a training step's estimated from them."""
    per_batch = settings.batch_prompts / settings.prompts  # one training step's share of the totals
    wall = {key.removeprefix("wall_"): sum(s.wall[key] for s in steps) for key in WALL_KEYS}
    policies: dict[str, dict[str, float]] = {}
    for name in settings.policies:
        policies[name] = {key: sum(s.costs[name][key] for s in steps) for key in COST_KEYS}
    tokens = {name: sum(s.tokens[name] for s in steps) for name in settings.policies}
    forwards = (UPDATE_FORWARDS + int(settings.reference_forward)) * settings.update_epochs
    update: dict[str, float | None] = {}
    for name, cost in policies.items():
        seconds = cost["time_peer_logprob"] + cost["candidates_time_peer_logprob"]
        rate = seconds / cost["scored_tokens"] if cost["scored_tokens"] else None
        update[name] = forwards * rate * cost["update_tokens"] * per_batch if rate is not None else None
    known = [v for v in update.values() if v is not None]
    # Local workers update one after another; Ray actors at once.
    update_total = (
        None if len(known) < len(update) else (max(known) if settings.backend == "ray" else sum(known))
    )
    rollout, scoring = wall["rollout"] * per_batch, wall["moved"] * per_batch
    return {
        "tokens_sampled": tokens,
        "seconds": {**wall, "total": sum(wall.values())},
        "per_policy": policies,
        "training_step": {
            "rollout": rollout,
            "peer_scoring": scoring,
            "update_estimate": update_total,
            "update_estimate_per_policy": update,
            "total": rollout + scoring + update_total if update_total is not None else None,
            "probe_per_batch": sum(wall.values()) * per_batch,
            "rule": (
                f"rollout and peer scoring measured (wall-clock per {settings.batch_prompts} prompts); "
                f"update = {forwards} forward passes per token x the tokens the update would train "
                "(own and moved rows, prompt + response), at the forward time per token of the "
                "probe's own no-grad scoring passes"
                + ("; policies update concurrently (Ray)" if settings.backend == "ray" else "")
            ),
        },
    }


def probe_statistics(settings: ProbeSettings, steps: Sequence[StepData]) -> dict[str, Any]:
    """Every figure of probe.json from the probe's steps."""
    n, threshold = settings.n, settings.success_threshold
    hits = {
        model: is_success(torch.cat([s.rewards[model] for s in steps]), threshold)  # [P, n]
        for model in settings.models
    }
    successes = {model: hit.sum(dim=-1) for model, hit in hits.items()}  # [P] each
    models = {}
    for model, k in successes.items():
        prompts = len(k)
        correct = int(hits[model].sum())
        all_fail, all_pass = int((k == 0).sum()), int((k == n).sum())
        models[model] = {
            "prompts": prompts,
            "responses": prompts * n,
            "correct": correct,
            "accuracy": correct / (prompts * n),
            "all_fail": all_fail / prompts,
            "all_pass": all_pass / prompts,
            "mixed": (prompts - all_fail - all_pass) / prompts,
        }
    per_batch = settings.batch_prompts / settings.prompts
    pairs = []
    for receiver in settings.policies:
        for source in settings.models:
            if source == receiver:
                continue
            k_r, k_s = successes[receiver], successes[source]
            failed = int((k_r == 0).sum())
            solved = int(((k_r == 0) & (k_s >= 1)).sum())
            candidates = int(transfer_candidates(k_r, k_s, n).sum())
            scored = [
                r for s in steps for r in s.candidates if r["receiver"] == receiver and r["source"] == source
            ]
            moved = _moved(steps, source, receiver, settings)
            selected = [r for r in scored if r["selected"]]
            pairs.append(
                {
                    "source": source,
                    "receiver": receiver,
                    "receiver_all_fail": failed,
                    "solved_by_source": solved,
                    "complementarity": _share(solved, failed),
                    "candidates": candidates,
                    "candidates_per_batch": candidates * per_batch,
                    "selected": moved["groups"],
                    "selected_per_batch": moved["groups"] * per_batch,
                    "scored": _scores(scored, settings.delta, threshold),
                    "selected_scored": _scores(selected, settings.delta, threshold),
                    "moved": moved,
                }
            )
    figures = {
        "probe": dataclasses.asdict(settings),
        "steps": len(steps),
        "models": models,
        "pairs": pairs,
        "cost": _cost(steps, settings),
    }
    if any(s.rescue for s in steps):
        figures["rescue"] = _rescue(steps, settings)
    figures["verdict"] = verdicts(figures)
    return figures


def _rescue(steps: Sequence[StepData], settings: ProbeSettings) -> dict[str, dict[str, Any]]:
    """Per receiver, what the hint's rescue round recovers: its all-fail prompts that a peer
    solved, sampled again with the hint, and the share of them solved at least once."""
    out = {}
    for name in settings.policies:
        attempted = int(sum(s.rescue.get(name, {}).get("rescue_attempted", 0) for s in steps))
        solved = int(sum(s.rescue.get(name, {}).get("rescue_solved", 0) for s in steps))
        out[name] = {"attempted": attempted, "solved": solved, "rescue_rate": _share(solved, attempted)}
    return out


def histogram_values(
    steps: Sequence[StepData], threshold: float = SUCCESS_THRESHOLD
) -> dict[str, dict[str, list[float]]]:
    """Direction -> "correct" / "wrong" -> s of every scored candidate response (the plots);
    correct: a reward at or above ``threshold``."""
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"correct": [], "wrong": []})
    for s in steps:
        for r in s.candidates:
            outcome = "correct" if is_success(r["reward"], threshold) else "wrong"
            out[_direction(r["source"], r["receiver"])][outcome].append(r["s"])
    return dict(out)


# ----- from the files ----------------------------------------------------------------------------


def read_steps(folder: str | Path, settings: ProbeSettings) -> list[StepData]:
    """The probe's steps rebuilt from its files alone (the recount's input)."""
    files = ProbeDir(folder)
    rows = {}
    for name in ("samples", "candidates", "compatibility", "moved_groups", "steps"):
        path = getattr(files, name)
        if not path.exists():
            raise ProbeError(f"{path}: missing; recount a folder written by `graftrl probe`")
        rows[name] = read_jsonl(path)
    out = []
    for step in sorted({r["step"] for r in rows["steps"]}):

        def at(name: str, step: int = step) -> list[dict[str, Any]]:
            return [r for r in rows[name] if r["step"] == step]

        samples = at("samples")
        ids = list(dict.fromkeys(r["prompt_id"] for r in samples))
        position = {prompt: p for p, prompt in enumerate(ids)}
        rewards = {}
        for model in settings.models:
            table = torch.zeros(len(ids), settings.n)  # [P, n]
            for r in samples:
                if r["model"] == model:
                    table[position[r["prompt_id"]], r["index"]] = r["reward"]
            rewards[model] = table
        by_policy = {r["model"]: r for r in at("steps")}
        first = next(iter(by_policy.values()))
        out.append(
            StepData(
                step=step,
                prompt_ids=ids,
                rewards=rewards,
                tokens={
                    name: sum(r["tokens"] for r in samples if r["model"] == name)
                    for name in settings.policies
                },
                candidates=at("candidates"),
                compatibility=at("compatibility"),
                moved_groups=at("moved_groups"),
                costs={name: {k: by_policy[name][k] for k in COST_KEYS} for name in settings.policies},
                wall={k: first[k] for k in WALL_KEYS},
                rescue={
                    name: {k: row[k] for k in RESCUE_KEYS}
                    for name, row in by_policy.items()
                    if "rescue_attempted" in row
                },
            )
        )
    return out


def recount(folder: str | Path) -> dict[str, Any]:
    """Every figure of ``folder``/probe.json, recomputed from the samples the probe wrote."""
    files = ProbeDir(folder)
    try:
        settings = ProbeSettings(**json.loads(files.json.read_text())["probe"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ProbeError(
            f"{files.json}: unreadable ({error}); recount a folder written by `graftrl probe`"
        ) from None
    return with_served(probe_statistics(settings, read_steps(folder, settings)), read_jsonl(files.steps))


def with_served(figures: dict[str, Any], step_rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The figures plus each served peer's answers and cost (steps.jsonl's ``served_*``), as JSON."""
    served = {
        c.peer: {**c.totals, "steps": c.steps, "groups_taken": c.selected, "transferred": c.transferred}
        for c in served_costs(step_rows)
    }
    return as_json({**figures, "served": served} if served else figures)


def as_json(figures: dict[str, Any]) -> dict[str, Any]:
    """The figures as probe.json holds them (tuples as lists, NaN as null)."""
    return json.loads(json.dumps(figures))
