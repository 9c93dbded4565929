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
from graftrl.core.advantages import ADV_EPS, ADV_STD_UNBIASED, grpo_advantages
from graftrl.core.compatibility import DELTA as DEFAULT_DELTA


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
    receiver."""

    responses: int
    passed: int
    """Responses with s > delta: those the gate admits (eq. 8)."""
    median_s: float | None

    @property
    def passed_share(self) -> float | None:
        return self.passed / self.responses if self.responses else None


def gate_by_outcome(
    records: Sequence[Mapping[str, Any]], delta: float = DEFAULT_DELTA
) -> dict[str, dict[str, GateOutcome]]:
    """receiver -> "correct" / "wrong" -> ``GateOutcome``, over ``compatibility.jsonl`` rows (a
    response is correct when its reward is positive).

    The gate is meant to remove stylistically foreign responses; when it passes fewer correct
    than wrong ones, it is removing the receiver's lesson (the informative tokens are the ones the
    receiver finds unlikely), which is what this measures.
    """
    scores: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"correct": [], "wrong": []})
    for record in records:
        for s, reward in zip(record["s"], record["reward"], strict=True):
            scores[record["receiver"]]["correct" if reward > 0 else "wrong"].append(float(s))
    return {
        receiver: {
            outcome: GateOutcome(
                len(values), sum(v > delta for v in values), statistics.median(values) if values else None
            )
            for outcome, values in by_outcome.items()
        }
        for receiver, by_outcome in sorted(scores.items())
    }


@dataclass(frozen=True)
class AdvantageMass:
    """The push a receiver's moved groups carried, per moved group: sum of w * A over the peer's
    correct responses and over its wrong ones (source advantages, eq. 1; weights w, eq. 8)."""

    groups: int
    correct: float
    wrong: float

    @property
    def net(self) -> float:
        return self.correct + self.wrong


def advantage_mass(
    records: Sequence[Mapping[str, Any]],
    n: int,
    delta: float | None = DEFAULT_DELTA,
    eps: float = ADV_EPS,
    unbiased: bool = ADV_STD_UNBIASED,
) -> dict[str, AdvantageMass] | None:
    """receiver -> ``AdvantageMass`` over ``compatibility.jsonl`` rows that hold whole source groups
    of ``n`` responses in order (GRAFT's group replacement); None when a row cannot (its length is
    not a multiple of n, e.g. success-only transfer). ``delta``: the gate's floor, w = 1[s > delta]
    min(s, 1) (eq. 8); None: no gate, w = 1.

    GRPO's advantages sum to 0 over a group, so with w = 1 the net is exactly 0: tokens that all of
    the peer's responses share (a step the receiver lacks, say) get no net push, only what separates
    the peer's correct responses from its wrong ones does. The gate makes the net positive only by
    admitting correct responses more often than wrong ones.
    """
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # groups, correct, wrong
    for record in records:
        s = torch.tensor(record["s"], dtype=torch.float32)  # [G * n]
        rewards = torch.tensor(record["reward"], dtype=torch.float32)  # [G * n]
        if len(s) % n:
            return None
        w = torch.ones_like(s) if delta is None else compatibility_weight(s, delta)  # [G * n]
        weighted = w * grpo_advantages(rewards.view(-1, n), eps, unbiased).view(-1)  # [G * n]
        correct = rewards > 0
        entry = sums[record["receiver"]]
        entry[0] += len(s) // n
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
