"""Diagnostics across runs, from what training logged: the training reward per family early and
late, the regime statistics of an exchange, how the gate met correct and wrong peer responses,
and the advantage mass the moved groups carried (compare's report, the demo, sweep and mastery).

Reads metrics.jsonl rows and compatibility.jsonl rows handed in; computes, never writes.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graftrl.core import compatibility_weight
from graftrl.core.advantages import ADV_EPS, ADV_STD_UNBIASED, SUCCESS_THRESHOLD, grpo_advantages, is_success
from graftrl.core.compatibility import DELTA as DEFAULT_DELTA
from graftrl.reporting.weights import WeightRule, applied_weights, logs_weights


def family_progress(
    curves: Mapping[str, Sequence[Mapping[str, Any]]], window: int = 10, prefix: str = "family_reward/"
) -> dict[str, dict[str, tuple[float, float]]]:
    """variant -> "<model> · <family>" -> (mean over its first ``window`` steps, over its last
    ``window``) of the training reward on that family, pooled over the runs labelled
    "<variant> seed <s>": did the model learn the family during training, not only at the end."""
    values: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for label, rows in curves.items():
        variant = label.split(" seed ")[0]
        for row in rows:
            for key, value in row.items():
                if key.startswith(prefix) and value is not None:
                    values[variant][f"{row['model']} · {key[len(prefix) :]}"].append(
                        (int(row["step"]), value)
                    )
    progress: dict[str, dict[str, tuple[float, float]]] = {}
    for variant, families in values.items():
        for family, points in sorted(families.items()):
            steps = sorted({step for step, _ in points})
            first, last = set(steps[:window]), set(steps[-window:])
            progress.setdefault(variant, {})[family] = (
                statistics.fmean(v for step, v in points if step in first),
                statistics.fmean(v for step, v in points if step in last),
            )
    return progress


@dataclass(frozen=True)
class GateOutcome:
    """How the gate met the transferred responses of one outcome (correct or wrong) into one
    receiver, and how many of them entered the loss."""

    responses: int
    passed: int
    """Responses with s > delta: those the gate admits (eq. 8), whether or not the run gated."""
    median_s: float | None
    admitted: int | None = None
    """Responses trained with w > 0 (the gate, no gate, random admission); None when unknown."""

    @property
    def passed_share(self) -> float | None:
        return self.passed / self.responses if self.responses else None

    @property
    def admitted_share(self) -> float | None:
        return self.admitted / self.responses if self.responses and self.admitted is not None else None


def gate_by_outcome(
    records: Sequence[Mapping[str, Any]],
    delta: float = DEFAULT_DELTA,
    rule: WeightRule | None = None,
    threshold: float = SUCCESS_THRESHOLD,
) -> dict[str, dict[str, GateOutcome]]:
    """receiver -> "correct" / "wrong" -> ``GateOutcome``, over ``compatibility.jsonl`` rows (a
    response is correct when its reward is a success: at or above ``threshold``, the run's
    ``reward.success_threshold``). Admitted: w > 0 of the logged weights, or of
    the weights ``rule`` recomputes for a row without them (default: the gate with ``delta``).

    The gate is meant to remove stylistically foreign responses; when it passes fewer correct
    than wrong ones, it is removing the receiver's lesson (the informative tokens are the ones the
    receiver finds unlikely), which is what this measures.
    """
    rule = rule or WeightRule("graft", delta=delta)
    scores: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"correct": [], "wrong": []})
    admitted: dict[str, dict[str, int | None]] = defaultdict(lambda: {"correct": 0, "wrong": 0})
    for record in records:
        weights = applied_weights(record, rule)
        for k, (s, reward) in enumerate(zip(record["s"], record["reward"], strict=True)):
            outcome = "correct" if is_success(reward, threshold) else "wrong"
            scores[record["receiver"]][outcome].append(float(s))
            count = admitted[record["receiver"]][outcome]
            if weights is None or count is None:
                admitted[record["receiver"]][outcome] = None
            else:
                admitted[record["receiver"]][outcome] = count + int(weights[k] > 0)
    return {
        receiver: {
            outcome: GateOutcome(
                len(values),
                sum(v > delta for v in values),
                statistics.median(values) if values else None,
                admitted[receiver][outcome],
            )
            for outcome, values in by_outcome.items()
        }
        for receiver, by_outcome in sorted(scores.items())
    }


@dataclass(frozen=True)
class AdvantageMass:
    """The push a receiver's moved groups carried, per moved group: sum of w * A over the peer's
    correct responses and over its wrong ones (the advantages and weights they were trained with)."""

    groups: int
    correct: float
    wrong: float

    @property
    def net(self) -> float:
        return self.correct + self.wrong


def logs_mass(record: Mapping[str, Any]) -> bool:
    """The row records what the push is made of: each response's weight, advantage and prompt."""
    count = len(record.get("s") or [])
    return logs_weights(record) and all(
        len(record.get(key) or []) == count for key in ("advantage", "prompt_id")
    )


def advantage_mass(
    records: Sequence[Mapping[str, Any]],
    n: int,
    rule: WeightRule | None = None,
    eps: float = ADV_EPS,
    unbiased: bool = ADV_STD_UNBIASED,
    threshold: float = SUCCESS_THRESHOLD,
) -> dict[str, AdvantageMass] | None:
    """receiver -> ``AdvantageMass`` over ``compatibility.jsonl`` rows; correct responses are the
    successes (reward at or above ``threshold``), wrong ones the rest.

    A row that records each response's w, advantage and prompt (``logs_mass``) counts as logged,
    whatever the transfer rule (pooled advantages, success-only, random admission, no gate); its
    moved groups are its (prompt, source) pairs. An older row is recomputed: advantages from the
    rewards of whole source groups of ``n`` responses in order (GRAFT's group replacement), weights
    with ``rule`` (default: the gate of eq. 8); None when a row cannot be (its length is not a
    multiple of n, e.g. success-only transfer, or random admission's weights).

    GRPO's advantages sum to 0 over a group, so with w = 1 the net is exactly 0: tokens that all of
    the peer's responses share (a step the receiver lacks, say) get no net push, only what separates
    the peer's correct responses from its wrong ones does. The gate makes the net positive only by
    admitting correct responses more often than wrong ones.
    """
    rule = rule or WeightRule("graft")
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # groups, correct, wrong
    for record in records:
        rewards = torch.tensor(record["reward"], dtype=torch.float32)  # [N]
        if logs_mass(record):
            w, advantage = (torch.tensor(record[key], dtype=torch.float64) for key in ("w", "advantage"))
            weighted = w * advantage  # [N]
            groups = len(set(zip(record["prompt_id"], record["source"], strict=True)))
        else:
            s = torch.tensor(record["s"], dtype=torch.float32)  # [G * n]
            if len(s) % n or not rule.recomputable:
                return None
            w = compatibility_weight(s, rule.delta) if rule.weighs else torch.ones_like(s)  # [G * n]
            weighted = w * grpo_advantages(rewards.view(-1, n), eps, unbiased).view(-1)  # [G * n]
            groups = len(s) // n
        correct = is_success(rewards, threshold)  # [N]
        entry = sums[record["receiver"]]
        entry[0] += groups
        entry[1] += float(weighted[correct].sum())
        entry[2] += float(weighted[~correct].sum())
    return {
        receiver: AdvantageMass(int(groups), correct / groups, wrong / groups)
        for receiver, (groups, correct, wrong) in sorted(sums.items())
        if groups
    }


def summarize_exchange(curves: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """The regime statistics of docs/task_design.md over runs labelled "<method> seed <s>".

    method -> receiver -> mean per-step all-fail share and complementarity (any peer), GRAFT's
    selected prompts per step, the transferred / admitted response totals of the receiver (all
    sources together; ``Exchange`` splits them per direction for one run) and the mean share of
    clipped token ratios on its own and on peer rows.
    """
    out: dict[str, Any] = {}
    for label, rows in curves.items():
        method = label.split()[0]
        for row in rows:
            entry = out.setdefault(method, {}).setdefault(
                row["model"],
                {
                    "all_fail": [],
                    "complementarity": [],
                    "selected": [],
                    "peer_responses": [],
                    "admitted": [],
                    "clip_frac_own": [],
                    "clip_frac_peer": [],
                },
            )
            for key in ("clip_frac_own", "clip_frac_peer"):
                if row.get(key) is not None:
                    entry[key].append(row[key])
            if row.get("all_fail_frac") is not None:
                entry["all_fail"].append(row["all_fail_frac"])
            entry["complementarity"] += [
                v for k, v in row.items() if k.startswith("complementarity/") and v is not None
            ]
            entry["selected"] += [v for k, v in row.items() if k.startswith("selected/")]
            entry["peer_responses"].append(row.get("peer_responses", 0))
            entry["admitted"].append(row.get("peer_admitted", 0))
    summary: dict[str, Any] = {}
    for method, models in out.items():
        for model, entry in models.items():
            transferred = sum(entry["peer_responses"])
            summary.setdefault(method, {})[model] = {
                "all_fail_mean": statistics.fmean(entry["all_fail"]) if entry["all_fail"] else None,
                "complementarity_mean": statistics.fmean(entry["complementarity"])
                if entry["complementarity"]
                else None,
                "selected_prompts_per_step": statistics.fmean(entry["selected"])
                if entry["selected"]
                else 0.0,
                "transferred_responses": transferred,
                "admitted_responses": sum(entry["admitted"]),
                "admit_rate": sum(entry["admitted"]) / transferred if transferred else None,
                "clip_frac_own": statistics.fmean(entry["clip_frac_own"]) if entry["clip_frac_own"] else None,
                "clip_frac_peer": statistics.fmean(entry["clip_frac_peer"])
                if entry["clip_frac_peer"]
                else None,
            }
    return summary
