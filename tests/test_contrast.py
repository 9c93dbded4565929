"""The contrast diagnostic (graftrl.core.contrast) on hand-built groups with known overlap, and its
metrics in a real GRAFT step (issue 21, item 1)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import CROSSED, ScriptedRewards, make_config

from graftrl.config import config_from_dict
from graftrl.core import grpo_advantages
from graftrl.core.contrast import (
    GroupContrast,
    common_prefix,
    contrast_metrics,
    group_contrast,
    shared_tokens,
)
from graftrl.training.trainer import Trainer


def pushes(correct: list[bool], w: list[float] | None = None) -> list[float]:
    """w * A with the group's GRPO advantages (eq. 1)."""
    advantages = grpo_advantages(torch.tensor([[float(c) for c in correct]]))[0]
    return [(1.0 if w is None else w[i]) * float(a) for i, a in enumerate(advantages)]


def test_one_changed_token_of_five():
    correct, wrong = [1, 2, 3, 4, 5], [1, 2, 9, 4, 5]
    c = group_contrast([correct, wrong], [True, False], pushes([True, False]))
    a = 1 / math.sqrt(2)  # n = 2, one success: advantages +-1/sqrt(2) (unbiased std)
    assert (c.groups, c.wrong) == (1, 1)
    assert c.overlap == pytest.approx(4 / 5) and c.divergence == pytest.approx(2 / 5)
    assert c.mass_correct_shared == pytest.approx(a * 4 / 5, rel=1e-5)
    assert c.mass_correct_distinct == pytest.approx(a / 5, rel=1e-5)
    assert c.mass_wrong_shared == pytest.approx(-a * 4 / 5, rel=1e-5)
    assert c.mass_wrong_distinct == pytest.approx(-a / 5, rel=1e-5)
    # The zero-sum advantages cancel on the shared tokens; the push is on the one that differs.
    assert c.mass_correct_shared + c.mass_wrong_shared == pytest.approx(0.0, abs=1e-6)


def test_a_wrong_response_that_shares_nothing():
    c = group_contrast([[1, 2, 3], [7, 8, 9, 6]], [True, False], pushes([True, False]))
    assert c.overlap == 0.0 and c.divergence == 0.0
    assert c.mass_correct_shared == 0.0 and c.mass_wrong_shared == 0.0


def test_the_closest_correct_response_is_the_reference():
    """A wrong response is compared with the correct one it shares most with."""
    correct_far, correct_near, wrong = [5, 6, 7, 8], [1, 2, 3, 0], [1, 2, 3, 4]
    c = group_contrast([correct_far, correct_near, wrong], [True, True, False], [0.0, 0.0, 0.0])
    assert c.overlap == pytest.approx(3 / 4) and c.divergence == pytest.approx(3 / 4)
    assert c.mass_correct_shared == 0.0  # nothing trained: no mass, the overlap is still measured


def test_the_four_masses_add_up_to_the_group_mass_and_success_only_pushes_no_wrong_row():
    tokens = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 9, 3, 4], [1, 2, 3, 4, 6], [8, 8]]
    correct = [True, True, False, False, True]
    w = [1.0, 0.9, 0.0, 0.85, 1.0]
    push = pushes(correct, w)
    c = group_contrast(tokens, correct, push)
    parts = c.mass_correct_shared + c.mass_correct_distinct + c.mass_wrong_shared + c.mass_wrong_distinct
    assert parts == pytest.approx(sum(push))
    only = group_contrast(tokens, correct, [p if k else 0.0 for p, k in zip(push, correct, strict=True)])
    assert only.mass_wrong_shared == only.mass_wrong_distinct == 0.0
    assert (only.overlap, only.wrong) == (c.overlap, c.wrong)


def test_a_group_with_one_outcome_measures_nothing():
    assert group_contrast([[1, 2], [1, 3]], [True, True], [0.0, 0.0]) == GroupContrast()
    assert contrast_metrics(GroupContrast()) == {}


def test_caps_bound_the_comparison():
    long_correct, long_wrong = list(range(5000)), [*range(100), *range(9000, 13900)]
    c = group_contrast([long_correct, long_wrong], [True, False], [0.0, 0.0], max_tokens=200)
    assert c.overlap == pytest.approx(100 / 200)  # only the first 200 tokens of each compared
    many = [[1, 2, 3]] * 20 + [[1, 2, 4]]
    # The wrong one meets at most 3 of the 20 correct ones; all are alike, so the result is the same.
    capped = group_contrast(many, [True] * 20 + [False], [0.0] * 21, max_pairs=3)
    assert capped.overlap == pytest.approx(2 / 3)


def test_shared_tokens_and_prefix():
    assert shared_tokens([1, 2, 3, 4, 5], [1, 3, 4, 9, 5]) == [True, False, True, True, True]
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0


def test_metrics_are_means_over_wrong_responses_and_groups():
    total = group_contrast([[1, 2, 3, 4, 5], [1, 2, 9, 4, 5]], [True, False], pushes([True, False]))
    total += group_contrast([[1, 2], [7, 8]], [True, False], pushes([True, False]))
    m = contrast_metrics(total)
    assert m["contrast_groups"] == 2
    assert m["contrast_overlap"] == pytest.approx((4 / 5 + 0) / 2)
    assert m["contrast_mass_correct_distinct"] == pytest.approx((1 / 5 + 1) / math.sqrt(2) / 2, rel=1e-5)


def test_a_graft_step_logs_the_contrast_and_the_transferred_responses(tiny_checkpoints, tmp_path):
    """Each receiver's moved group (CROSSED: one per direction) is measured; compatibility.jsonl
    carries the applied weight, the advantage, the prompt id and (log_transfers) the text."""
    raw = make_config(tiny_checkpoints, steps=1)
    raw["graft"] = {"gate": False}  # w = 1: every moved response trained
    raw["logging"]["log_transfers"] = True
    trainer = Trainer(config_from_dict(raw), tmp_path / "run", verifier=ScriptedRewards(CROSSED))
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    compatibility = [
        json.loads(line) for line in (tmp_path / "run" / "compatibility.jsonl").read_text().splitlines()
    ]
    for row in rows:
        assert row["contrast_groups"] == 1, row
        assert 0.0 <= row["contrast_overlap"] <= 1.0
        scores = next(c for c in compatibility if c["receiver"] == row["model"])
        assert len(scores["response"]) == len(scores["s"]) == len(scores["prompt_id"]) == 4
        assert scores["w"] == [1.0] * 4
        correct = [r > 0 for r in scores["reward"]]
        # The logged advantages are the source group's: their w·A over the four masses is the group's.
        masses = sum(
            row[f"contrast_mass_{o}_{t}"] for o in ("correct", "wrong") for t in ("shared", "distinct")
        )
        assert masses == pytest.approx(sum(scores["advantage"]), abs=1e-4)
        assert any(correct) and not all(correct)
