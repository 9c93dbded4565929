"""What the moved groups could teach, per run and receiver: the contrast diagnostic over training,
the errors of the peer's wrong responses, and the clipping of peer tokens by the advantage's sign.

Reads what training logged (metrics.jsonl's ``contrast_*`` and ``clip_frac_peer_*`` keys,
compatibility.jsonl's transferred responses); computes, never writes (render and plots do).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from graftrl.core.advantages import SUCCESS_THRESHOLD, is_success

MASSES = ("mass_correct_shared", "mass_correct_distinct", "mass_wrong_shared", "mass_wrong_distinct")
"""The four parts of a moved group's w·A (graftrl.core.contrast), as logged with ``contrast_``."""


def contrast_summary(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """receiver -> the run's contrast: overlap and divergence (means over steps, each step weighted
    by its moved groups), the four masses per moved group, their net on shared and on distinct
    tokens, and moved groups per step. Receivers that moved nothing are absent."""
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row in rows:
        groups = row.get("contrast_groups") or 0
        total = sums[row["model"]]
        total["steps"] += 1
        if not groups:
            continue
        total["groups"] += groups
        for key in ("overlap", "divergence", "lesson"):
            if row.get(f"contrast_{key}") is not None:
                total[key] += row[f"contrast_{key}"] * groups
                total[f"{key}_groups"] += groups
        for key in MASSES:
            total[key] += (row.get(f"contrast_{key}") or 0.0) * groups
    out: dict[str, dict[str, float | None]] = {}
    for model, total in sums.items():
        groups = total["groups"]
        if not groups:
            continue
        entry: dict[str, float | None] = {
            "groups_per_step": groups / total["steps"],
            **{
                key: total[key] / total[f"{key}_groups"] if total[f"{key}_groups"] else None
                for key in ("overlap", "divergence", "lesson")
            },
            **{key: total[key] / groups for key in MASSES},
        }
        entry["mass_shared"] = entry["mass_correct_shared"] + entry["mass_wrong_shared"]  # type: ignore[operator]
        entry["mass_distinct"] = entry["mass_correct_distinct"] + entry["mass_wrong_distinct"]  # type: ignore[operator]
        out[model] = entry
    return out


def clipping_by_sign(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """receiver -> mean per step of clipped peer tokens with a positive and a negative advantage
    (``clip_frac_peer_pos`` / ``_neg``; steps that had such tokens)."""
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        for sign in ("pos", "neg"):
            if row.get(f"clip_frac_peer_{sign}") is not None:
                values[row["model"]][sign].append(row[f"clip_frac_peer_{sign}"])
    return {
        model: {sign: sum(v[sign]) / len(v[sign]) if v[sign] else None for sign in ("pos", "neg")}
        for model, v in values.items()
    }


def moved_error_classes(
    scores: Iterable[Mapping[str, Any]],
    problems: Mapping[str, str],
    classify: Callable[[str, str], str],
    outcomes: Sequence[str],
    threshold: float = SUCCESS_THRESHOLD,
) -> dict[str, dict[str, Any]]:
    """receiver -> the share of each error class among the wrong peer responses it was given
    (wrong: a reward below ``threshold``, the run's ``reward.success_threshold``).

    ``scores``: compatibility.jsonl rows written with ``logging.log_transfers`` (rows without
    texts are skipped); ``problems``: prompt id -> problem text; ``classify(problem, response)``
    returns one of ``outcomes`` (e.g. ``embedded.task.classify_worked``) or raises ValueError for a
    problem it does not read (skipped). Also the count of wrong responses classified."""
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for row in scores:
        texts = row.get("response")
        if not texts:
            continue
        for prompt_id, text, reward in zip(row["prompt_id"], texts, row["reward"], strict=True):
            if is_success(reward, threshold) or prompt_id not in problems:
                continue
            try:
                counts[row["receiver"]][classify(problems[prompt_id], text)] += 1
            except ValueError:  # a problem the classifier does not read (another task's)
                continue
    return {
        receiver: {
            "wrong_responses": sum(count.values()),
            **{name: count[name] / max(sum(count.values()), 1) for name in outcomes if name != "correct"},
        }
        for receiver, count in counts.items()
    }
