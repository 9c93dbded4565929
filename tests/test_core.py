"""Unit and property tests for ``graftrl.core``.

Every expected number below is derived by hand from docs/algorithm.md (sections 1, 2.1, 2.2, 5), not by
re-running the implementation's formula.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from graftrl.core import (
    balanced_selection,
    clipped_policy_loss,
    clipped_token_mask,
    compatibility_score,
    compatibility_weight,
    grpo_advantages,
    mean_token_logprob,
    minibatch_order,
    select_with_ties,
    transfer_candidates,
    truncated_is_weights,
)

EPS_LOW, EPS_HIGH = 0.2, 0.28
PROPERTY = settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _bool(xs: list[int] | list[bool]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.bool)


def _long(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)


# --------------------------------------------------------------------------------------------
# Section 1, eq. 1: group advantages
# --------------------------------------------------------------------------------------------


class TestGrpoAdvantages:
    def test_one_success_of_four_unbiased(self):
        # mean = 0.25; deviations 0.75, -0.25 x3; sum of squares = 0.5625 + 3 * 0.0625 = 0.75;
        # unbiased var = 0.75 / 3 = 0.25 -> std = 0.5 -> a = 0.75/0.5 = 1.5, -0.25/0.5 = -0.5.
        adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
        expected = torch.tensor([[0.75, -0.25, -0.25, -0.25]]) / (0.5 + 1e-6)
        torch.testing.assert_close(adv, expected)
        torch.testing.assert_close(adv, torch.tensor([[1.5, -0.5, -0.5, -0.5]]), atol=1e-5, rtol=0)

    def test_one_success_of_four_biased(self):
        # biased var = 0.75 / 4 = 0.1875 -> std = sqrt(3)/4 -> a = 0.75/(sqrt(3)/4) = sqrt(3),
        # -0.25/(sqrt(3)/4) = -1/sqrt(3).
        adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), unbiased=False)
        s3 = math.sqrt(3.0)
        torch.testing.assert_close(adv, torch.tensor([[s3, -1 / s3, -1 / s3, -1 / s3]]), atol=1e-5, rtol=0)

    def test_half_success_unbiased_and_biased(self):
        # mean 0.5, deviations +-0.5, sum sq = 1. unbiased std = sqrt(1/3) -> a = +-sqrt(3)/2;
        # biased std = sqrt(1/4) = 0.5 -> a = +-1.
        r = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
        h = math.sqrt(3.0) / 2
        torch.testing.assert_close(grpo_advantages(r), torch.tensor([[h, h, -h, -h]]), atol=1e-5, rtol=0)
        torch.testing.assert_close(
            grpo_advantages(r, unbiased=False), torch.tensor([[1.0, 1.0, -1.0, -1.0]]), atol=1e-5, rtol=0
        )

    def test_eps_is_added_to_std(self):
        # with eps = 0.5: unbiased std 0.5 -> denominator 1.0 -> a = r - mean exactly.
        adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), eps=0.5)
        torch.testing.assert_close(adv, torch.tensor([[0.75, -0.25, -0.25, -0.25]]))

    def test_zero_variance_groups_are_exactly_zero(self):
        r = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
        for unbiased in (True, False):
            adv = grpo_advantages(r, unbiased=unbiased)
            assert torch.equal(adv[:2], torch.zeros(2, 4))
            assert (adv[2] != 0).all()

    def test_single_rollout_is_zero(self):
        adv = grpo_advantages(torch.tensor([[1.0], [0.0]]))
        assert torch.equal(adv, torch.zeros(2, 1))
        assert not torch.isnan(adv).any()

    def test_integer_and_bool_rewards_give_float(self):
        adv_int = grpo_advantages(torch.tensor([[1, 0, 0, 0]]))
        adv_bool = grpo_advantages(torch.tensor([[True, False, False, False]]))
        assert adv_int.is_floating_point() and adv_bool.is_floating_point()
        torch.testing.assert_close(adv_int, torch.tensor([[1.5, -0.5, -0.5, -0.5]]), atol=1e-5, rtol=0)
        torch.testing.assert_close(adv_bool, adv_int)

    def test_groups_are_independent(self):
        # normalisation is per row (per prompt), never across the batch
        r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
        adv = grpo_advantages(r)
        torch.testing.assert_close(adv[0], grpo_advantages(r[:1])[0])
        torch.testing.assert_close(adv[1], grpo_advantages(r[1:])[0])

    @PROPERTY
    @given(
        rows=st.lists(
            st.lists(st.sampled_from([0.0, 1.0]), min_size=2, max_size=16), min_size=1, max_size=6
        ).map(lambda rs: [r[: min(len(x) for x in rs)] for r in rs]),
        unbiased=st.booleans(),
    )
    def test_property_standardised(self, rows, unbiased):
        # (7) non-degenerate groups: mean 0 and std (same correction) = std/(std+eps) ~ 1;
        # degenerate groups: exactly 0.
        r = torch.tensor(rows, dtype=torch.float64)
        n = r.shape[1]
        adv = grpo_advantages(r, unbiased=unbiased).double()
        for p in range(r.shape[0]):
            vals = rows[p]
            if len(set(vals)) == 1:
                assert torch.equal(adv[p], torch.zeros(n, dtype=torch.float64))
                continue
            mean = sum(vals) / n
            ss = sum((v - mean) ** 2 for v in vals)
            std = math.sqrt(ss / (n - 1 if unbiased else n))
            assert abs(float(adv[p].mean())) < 1e-5
            got_std = float(adv[p].std(correction=1 if unbiased else 0))
            assert got_std == pytest.approx(std / (std + 1e-6), abs=1e-5)
            assert got_std == pytest.approx(1.0, abs=1e-4)
            # sign follows the reward: successes get a > 0, failures a < 0
            for v, a in zip(vals, adv[p].tolist(), strict=True):
                assert (a > 0) == (v > mean)


# --------------------------------------------------------------------------------------------
# Section 2.1: candidates and balanced selection
# --------------------------------------------------------------------------------------------


class TestTransferCandidates:
    def test_hand_example(self):
        n = 8
        k_receiver = _long([0, 0, 0, 0, 1, 0, 8, 0])
        k_source = _long([0, 1, 7, 8, 3, 4, 4, 8])
        # p0: source all-fail -> no; p1, p2, p5: mixed source & receiver failed -> yes;
        # p3, p7: source all-pass (k_S == n) -> no; p4, p6: receiver succeeded -> no.
        expected = _bool([0, 1, 1, 0, 0, 1, 0, 0])
        got = transfer_candidates(k_receiver, k_source, n)
        assert got.dtype == torch.bool
        assert torch.equal(got, expected)

    def test_empty(self):
        got = transfer_candidates(_long([]), _long([]), 4)
        assert got.shape == (0,) and got.dtype == torch.bool


class TestSelectWithTies:
    def test_ties_at_boundary_kept(self):
        # m = 2 of source counts [5, 3, 3, 3]: first two are 5, 3; the boundary value 3 is tied by
        # two more -> all four kept.
        cands = _bool([1, 1, 1, 1])
        got = select_with_ties(cands, _long([5, 3, 3, 3]), 2)
        assert torch.equal(got, _bool([1, 1, 1, 1]))

    def test_no_ties(self):
        got = select_with_ties(_bool([1, 1, 1, 1]), _long([1, 6, 3, 5]), 2)
        assert torch.equal(got, _bool([0, 1, 0, 1]))

    def test_tie_above_boundary_is_not_extra(self):
        # [7, 4, 4, 2], m = 2: first two 7, 4; tie with the other 4 -> 3 kept; 2 dropped
        got = select_with_ties(_bool([1, 1, 1, 1]), _long([2, 4, 7, 4]), 2)
        assert torch.equal(got, _bool([0, 1, 1, 1]))

    def test_non_candidates_do_not_rank(self):
        # p0 has the largest source count but is not a candidate: it neither gets selected nor
        # pushes the boundary.
        got = select_with_ties(_bool([0, 1, 1, 1]), _long([7, 2, 5, 1]), 1)
        assert torch.equal(got, _bool([0, 0, 1, 0]))

    def test_m_zero_and_m_large(self):
        cands = _bool([1, 0, 1])
        k = _long([3, 5, 1])
        assert torch.equal(select_with_ties(cands, k, 0), _bool([0, 0, 0]))
        assert torch.equal(select_with_ties(cands, k, 2), cands)
        assert torch.equal(select_with_ties(cands, k, 10), cands)
        assert torch.equal(select_with_ties(_bool([0, 0, 0]), k, 2), _bool([0, 0, 0]))


class TestBalancedSelection:
    def test_ties_and_unequal_counts(self):
        n = 8
        # prompts 0-3: B failed, A has 5,3,3,3 successes -> C_{A->B} = {0,1,2,3};
        # prompts 4-5: A failed, B has 2,6 -> C_{B->A} = {4,5}; prompt 6: both fail; prompt 7:
        # A all-pass, B failed -> not a candidate.  m = min(4, 2) = 2.
        k_a = _long([5, 3, 3, 3, 0, 0, 0, 8])
        k_b = _long([0, 0, 0, 0, 2, 6, 0, 0])
        a_to_b, b_to_a = balanced_selection(k_a, k_b, n)
        assert torch.equal(a_to_b, _bool([1, 1, 1, 1, 0, 0, 0, 0]))  # 4 selected (ties) > m
        assert torch.equal(b_to_a, _bool([0, 0, 0, 0, 1, 1, 0, 0]))  # 2 selected == m

    def test_top_m_by_source_successes(self):
        n = 8
        # C_{A->B} = {0,1,2,3} with k_A = 1,6,3,5; C_{B->A} = {4,5}; m = 2 -> keep k_A 6 and 5.
        k_a = _long([1, 6, 3, 5, 0, 0])
        k_b = _long([0, 0, 0, 0, 7, 1])
        a_to_b, b_to_a = balanced_selection(k_a, k_b, n)
        assert torch.equal(a_to_b, _bool([0, 1, 0, 1, 0, 0]))
        assert torch.equal(b_to_a, _bool([0, 0, 0, 0, 1, 1]))

    def test_m_zero_moves_nothing(self):
        n = 4
        # C_{A->B} = {0, 1}; C_{B->A} is empty (p2: B all-pass; p3: A succeeded) -> m = 0.
        k_a = _long([3, 1, 0, 2])
        k_b = _long([0, 0, 4, 2])
        a_to_b, b_to_a = balanced_selection(k_a, k_b, n)
        assert not a_to_b.any()
        assert not b_to_a.any()
        # without balancing every candidate moves
        a_to_b, b_to_a = balanced_selection(k_a, k_b, n, balance=False)
        assert torch.equal(a_to_b, _bool([1, 1, 0, 0]))
        assert torch.equal(b_to_a, _bool([0, 0, 0, 0]))

    def test_balance_false_selects_every_candidate(self):
        n = 8
        k_a = _long([5, 3, 3, 3, 0, 0, 1])
        k_b = _long([0, 0, 0, 0, 2, 6, 0])
        a_to_b, b_to_a = balanced_selection(k_a, k_b, n, balance=False)
        assert torch.equal(a_to_b, _bool([1, 1, 1, 1, 0, 0, 1]))
        assert torch.equal(b_to_a, _bool([0, 0, 0, 0, 1, 1, 0]))

    @staticmethod
    @st.composite
    def _pairs(draw):
        n = draw(st.integers(1, 8))
        p = draw(st.integers(0, 24))
        k = st.lists(st.integers(0, n), min_size=p, max_size=p)
        return n, draw(k), draw(k)

    @PROPERTY
    @given(data=_pairs(), balance=st.booleans())
    def test_property_selection(self, data, balance):
        n, ka, kb = data
        k_a, k_b = _long(ka), _long(kb)
        a_to_b, b_to_a = balanced_selection(k_a, k_b, n, balance=balance)
        cand_ab = [kb[q] == 0 and 1 <= ka[q] < n for q in range(len(ka))]
        cand_ba = [ka[q] == 0 and 1 <= kb[q] < n for q in range(len(ka))]
        m = min(sum(cand_ab), sum(cand_ba))
        for sel, cand, k_src, k_rcv in ((a_to_b, cand_ab, ka, kb), (b_to_a, cand_ba, kb, ka)):
            sel = sel.tolist()
            # (2) never a prompt the receiver solved, never an all-pass/all-fail source group
            for q, s in enumerate(sel):
                if s:
                    assert k_rcv[q] == 0
                    assert 1 <= k_src[q] < n
            # (3) subset of candidates
            assert all(c for s, c in zip(sel, cand, strict=True) if s)
            if not balance:
                assert sel == cand
                continue
            count = sum(sel)
            if m == 0:
                assert count == 0
                continue
            assert count >= m
            chosen = [k_src[q] for q in range(len(sel)) if sel[q]]
            rest = [k_src[q] for q in range(len(sel)) if cand[q] and not sel[q]]
            # top-m plus boundary ties: the m-th largest candidate count is the cut
            boundary = sorted((k_src[q] for q in range(len(sel)) if cand[q]), reverse=True)[m - 1]
            assert min(chosen) == boundary
            assert all(r < boundary for r in rest)
            assert count == m + sum(1 for c in chosen if c == boundary) - sum(
                1 for c in sorted(chosen, reverse=True)[:m] if c == boundary
            )
            cand_counts = [k_src[q] for q in range(len(sel)) if cand[q]]
            if len(set(cand_counts)) == len(cand_counts):
                assert count == m

    @PROPERTY
    @given(data=_pairs(), balance=st.booleans())
    def test_property_symmetry(self, data, balance):
        # (4) swapping A and B swaps the outputs
        n, ka, kb = data
        a_to_b, b_to_a = balanced_selection(_long(ka), _long(kb), n, balance=balance)
        b_to_a2, a_to_b2 = balanced_selection(_long(kb), _long(ka), n, balance=balance)
        assert torch.equal(a_to_b, a_to_b2)
        assert torch.equal(b_to_a, b_to_a2)


# --------------------------------------------------------------------------------------------
# Section 2.2, eqs. 6-8: mean log-prob, compatibility score and weight
# --------------------------------------------------------------------------------------------


class TestCompatibility:
    def test_mean_token_logprob(self):
        lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -4.0], [-9.0, -9.0, -9.0]])
        mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
        # (-1-2)/2 = -1.5; (-0.5-0.5-4)/3 = -5/3; empty row -> 0
        got = mean_token_logprob(lp, mask)
        torch.testing.assert_close(got, torch.tensor([-1.5, -5.0 / 3.0, 0.0]))

    def test_mean_token_logprob_bool_mask(self):
        lp = torch.tensor([[-2.0, -4.0]])
        got = mean_token_logprob(lp, torch.tensor([[True, True]]))
        torch.testing.assert_close(got, torch.tensor([-3.0]))

    def test_score(self):
        # s = exp(lbar_R - lbar_S): receiver -1.0 vs source -1.5 -> e^0.5; equal -> 1; -2 vs -1 -> e^-1
        rec = torch.tensor([-1.0, -0.7, -2.0])
        src = torch.tensor([-1.5, -0.7, -1.0])
        got = compatibility_score(rec, src)
        torch.testing.assert_close(got, torch.tensor([math.exp(0.5), 1.0, math.exp(-1.0)]))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_weight_gate_and_cap(self, dtype):
        s = torch.tensor([0.0, 0.5, 0.8, 0.81, 0.95, 1.0, 1.7, 40.0], dtype=dtype)
        # 1[s > 0.8] * min(s, 1): exactly delta is gated out (strict >); s > 1 capped to 1
        expected = torch.tensor([0.0, 0.0, 0.0, 0.81, 0.95, 1.0, 1.0, 1.0], dtype=dtype)
        torch.testing.assert_close(compatibility_weight(s), expected)
        torch.testing.assert_close(compatibility_weight(s, delta=0.8), expected)

    def test_weight_custom_delta(self):
        s = torch.tensor([0.0, 1e-6, 0.3, 0.5, 2.0])
        torch.testing.assert_close(
            compatibility_weight(s, delta=0.0), torch.tensor([0.0, 1e-6, 0.3, 0.5, 1.0])
        )
        torch.testing.assert_close(
            compatibility_weight(s, delta=0.5), torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])
        )

    def test_end_to_end_weight(self):
        # receiver lbar -1.1, source lbar -1.0 -> s = e^-0.1 ~ 0.905 > 0.8 -> w = 0.905;
        # receiver lbar -1.3 -> s = e^-0.3 ~ 0.741 -> w = 0; receiver lbar -0.2 -> s = e^0.8 > 1 -> 1
        s = compatibility_score(torch.tensor([-1.1, -1.3, -0.2]), torch.tensor([-1.0, -1.0, -1.0]))
        w = compatibility_weight(s)
        torch.testing.assert_close(w, torch.tensor([math.exp(-0.1), 0.0, 1.0]))

    @PROPERTY
    @given(
        logs=st.lists(st.floats(-5.0, 5.0, allow_nan=False), min_size=1, max_size=32),
        delta=st.floats(0.0, 0.99),
    )
    def test_property_weight_range(self, logs, delta):
        # (5) w in {0} U (delta, 1], and equals min(s, 1) whenever s > delta
        s = torch.exp(torch.tensor(logs, dtype=torch.float64))
        w = compatibility_weight(s, delta=delta)
        for si, wi in zip(s.tolist(), w.tolist(), strict=True):
            if si > delta:
                assert wi == min(si, 1.0)
                assert delta < wi <= 1.0
            else:
                assert wi == 0.0


# --------------------------------------------------------------------------------------------
# Eqs. 2, 9, 10 and section 5: the clipped objective and its metrics
# --------------------------------------------------------------------------------------------


def _hand_batch():
    """A 3-row batch whose objective is computed by hand in the tests below.

    eps_low = 0.2, eps_high = 0.28 -> clip range [0.8, 1.28].
    row 0: a = +1, w = 1,   rho = 1.5, 0.5, 1.0 (all in mask)
           min(1.5, 1.28) = 1.28 (clipped); min(0.5, 0.5) = 0.5 (a>0, rho<1: not clipped); 1.0
           row sum = 2.78
    row 1: a = -2, w = 0.5, rho = 0.5, 1.5, 3.0 (third token masked out)
           min(-1.0, 0.8 * -2 = -1.6) = -1.6 (clipped: a<0, rho<0.8); min(-3.0, -2.56) = -3.0
           row sum = -4.6, weighted -2.3
    row 2: a = +3, w = 0 (removed), rho = 2.0, 2.0: counts nowhere
    J = (2.78 - 2.3) / (3 + 2 tokens) = 0.48 / 5 = 0.096
    """
    ratio = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 3.0], [2.0, 2.0, 1.0]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2], [-0.7, -0.1, -3.0]], dtype=torch.float64)
    logp = old + torch.log(ratio)
    adv = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    w = torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]])
    return logp, old, adv, w, mask


class TestClippedPolicyLoss:
    def test_hand_value(self):
        logp, old, adv, w, mask = _hand_batch()
        loss, metrics = clipped_policy_loss(logp, old, adv, w, mask, EPS_LOW, EPS_HIGH)
        assert float(loss) == pytest.approx(-0.096, abs=1e-9)
        # had the weight-0 row counted in the denominator it would be 0.48 / 7
        assert float(loss) != pytest.approx(-0.48 / 7, abs=1e-6)
        assert float(metrics["tokens"]) == 5
        assert float(metrics["clipped_tokens"]) == 2
        assert float(metrics["clip_fraction"]) == pytest.approx(2 / 5)

    def test_default_eps_are_spec_values(self):
        logp, old, adv, w, mask = _hand_batch()
        loss, _ = clipped_policy_loss(logp, old, adv, w, mask)
        assert float(loss) == pytest.approx(-0.096, abs=1e-9)

    def test_normalizer_override(self):
        logp, old, adv, w, mask = _hand_batch()
        loss, metrics = clipped_policy_loss(logp, old, adv, w, mask, normalizer=10.0)
        assert float(loss) == pytest.approx(-0.048, abs=1e-9)
        loss_t, _ = clipped_policy_loss(logp, old, adv, w, mask, normalizer=torch.tensor(10.0))
        assert float(loss_t) == pytest.approx(-0.048, abs=1e-9)
        assert float(metrics["tokens"]) == 5  # token count metric is still this call's count

    def test_micro_batches_with_shared_normalizer_sum_to_full(self):
        logp, old, adv, w, mask = _hand_batch()
        parts = [
            clipped_policy_loss(logp[s], old[s], adv[s], w[s], mask[s], normalizer=5.0)[0]
            for s in (slice(0, 1), slice(1, 3))
        ]
        assert float(sum(parts)) == pytest.approx(-0.096, abs=1e-9)

    def test_own_peer_split(self):
        logp, old, adv, w, mask = _hand_batch()
        is_peer = _bool([0, 1, 1])
        _, metrics = clipped_policy_loss(logp, old, adv, w, mask, is_peer=is_peer)
        # own = row 0: 3 tokens, 1 clipped; peer = row 1 (2 tokens, 1 clipped) + row 2 removed
        assert float(metrics["own_tokens"]) == 3
        assert float(metrics["own_clipped_tokens"]) == 1
        assert float(metrics["peer_tokens"]) == 2
        assert float(metrics["peer_clipped_tokens"]) == 1
        _, no_split = clipped_policy_loss(logp, old, adv, w, mask)
        assert "peer_tokens" not in no_split and "own_tokens" not in no_split

    def test_gradient(self):
        # d(-J)/d logp_{j,t} = -w_j * a_j * rho_{j,t} / N for unclipped tokens, 0 for clipped,
        # masked and removed ones. N = 5.
        logp, old, adv, w, mask = _hand_batch()
        logp = logp.clone().requires_grad_(True)
        loss, _ = clipped_policy_loss(logp, old, adv, w, mask)
        loss.backward()
        expected = torch.tensor(
            [
                [0.0, -1 * 0.5 / 5, -1 * 1.0 / 5],  # rho=1.5 clipped; rho 0.5, 1.0 unclipped
                [0.0, -0.5 * -2 * 1.5 / 5, 0.0],  # rho=0.5 clipped; rho=1.5 unclipped; masked
                [0.0, 0.0, 0.0],  # weight-0 row
            ],
            dtype=torch.float64,
        )
        torch.testing.assert_close(logp.grad, expected)

    def test_weight_zero_rows_get_zero_gradient_even_if_extreme(self):
        torch.manual_seed(0)
        B, T = 4, 5
        logp = (torch.randn(B, T, dtype=torch.float64) - 1).requires_grad_(True)
        old = torch.randn(B, T, dtype=torch.float64) - 1
        adv = torch.tensor([1.0, -1.0, 2.0, -3.0], dtype=torch.float64)
        w = torch.tensor([0.0, 0.9, 0.0, 1.0], dtype=torch.float64)
        mask = torch.ones(B, T)
        loss, metrics = clipped_policy_loss(logp, old, adv, w, mask)
        loss.backward()
        assert torch.equal(logp.grad[0], torch.zeros(T, dtype=torch.float64))
        assert torch.equal(logp.grad[2], torch.zeros(T, dtype=torch.float64))
        assert float(metrics["tokens"]) == 2 * T
        # removing the weight-0 rows entirely gives the same loss
        loss_kept, _ = clipped_policy_loss(logp[[1, 3]], old[[1, 3]], adv[[1, 3]], w[[1, 3]], mask[[1, 3]])
        assert loss.item() == pytest.approx(loss_kept.item(), abs=1e-12)

    def test_all_rows_removed(self):
        logp, old, adv, _, mask = _hand_batch()
        loss, metrics = clipped_policy_loss(logp, old, adv, torch.zeros(3, dtype=torch.float64), mask)
        assert float(loss) == 0.0
        assert float(metrics["tokens"]) == 0
        assert float(metrics["clip_fraction"]) == 0.0

    def test_ratio_one_gives_minus_mean_advantage_per_token(self):
        # rho = 1 everywhere: J = sum_j |o_j| a_j / sum_j |o_j|; lengths 2, 1 with a = 1, -4 -> -2/3
        lp = torch.zeros(2, 2, dtype=torch.float64)
        loss, metrics = clipped_policy_loss(
            lp, lp, torch.tensor([1.0, -4.0]).double(), torch.ones(2).double(), torch.tensor([[1, 1], [1, 0]])
        )
        assert float(loss) == pytest.approx(2 / 3)
        assert float(metrics["clipped_tokens"]) == 0

    def test_clipped_token_mask(self):
        ratio = torch.tensor([[1.5, 0.5, 1.1], [0.5, 1.5, 0.9], [2.0, 0.1, 1.0]])
        adv = torch.tensor([1.0, -1.0, 0.0])
        # a > 0: only rho > 1.28 clipped; a < 0: only rho < 0.8 clipped; a == 0: never
        expected = _bool([[1, 0, 0], [1, 0, 0], [0, 0, 0]])
        assert torch.equal(clipped_token_mask(ratio, adv, EPS_LOW, EPS_HIGH), expected)

    @staticmethod
    @st.composite
    def _loss_batch(draw, with_weights: bool):
        B = draw(st.integers(1, 4))
        T = draw(st.integers(1, 6))
        f = st.floats
        old = draw(st.lists(f(-6.0, 0.0), min_size=B * T, max_size=B * T))
        delta = draw(st.lists(f(-1.0, 1.0), min_size=B * T, max_size=B * T))
        mask = draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))
        adv = draw(st.lists(f(-3.0, 3.0), min_size=B, max_size=B))
        if with_weights:
            w = draw(st.lists(st.one_of(st.just(0.0), f(0.81, 1.0)), min_size=B, max_size=B))
        else:
            w = [1.0] * B
        return B, T, old, delta, mask, adv, w

    @staticmethod
    def _reference_objective(B, T, old, delta, mask, adv, w):
        """Eq. 2 / eq. 10 in plain Python floats; rows with w = 0 drop out of both sums."""
        num, den = 0.0, 0
        for j in range(B):
            if w[j] == 0:
                continue
            for t in range(T):
                if not mask[j * T + t]:
                    continue
                rho = math.exp(delta[j * T + t])
                clipped = min(max(rho, 1 - EPS_LOW), 1 + EPS_HIGH)
                num += w[j] * min(rho * adv[j], clipped * adv[j])
                den += 1
        return num, den

    @PROPERTY
    @given(batch=_loss_batch(with_weights=False))
    def test_property_no_transfer_is_dapo(self, batch):
        # (1) all weights 1, no peer rows: GRAFT's objective is GRPO's DAPO token-mean objective
        B, T, old, delta, mask, adv, w = batch
        assume(any(mask))
        num, den = self._reference_objective(B, T, old, delta, mask, adv, w)
        old_t = torch.tensor(old, dtype=torch.float64).view(B, T)
        logp_t = old_t + torch.tensor(delta, dtype=torch.float64).view(B, T)
        mask_t = torch.tensor(mask).view(B, T)
        adv_t = torch.tensor(adv, dtype=torch.float64)
        loss, metrics = clipped_policy_loss(
            logp_t,
            old_t,
            adv_t,
            torch.ones(B, dtype=torch.float64),
            mask_t,
            is_peer=torch.zeros(B, dtype=torch.bool),
        )
        assert float(loss) == pytest.approx(-num / den, rel=1e-9, abs=1e-12)
        assert float(metrics["tokens"]) == den
        assert float(metrics["peer_tokens"]) == 0
        assert float(metrics["own_tokens"]) == den
        n_clip = sum(
            1
            for j in range(B)
            for t in range(T)
            if mask[j * T + t]
            and (
                (adv[j] > 0 and math.exp(delta[j * T + t]) > 1 + EPS_HIGH)
                or (adv[j] < 0 and math.exp(delta[j * T + t]) < 1 - EPS_LOW)
            )
        )
        assert float(metrics["clipped_tokens"]) == n_clip

    @PROPERTY
    @given(batch=_loss_batch(with_weights=True))
    def test_property_weighted_objective(self, batch):
        # eq. 10 with weights: weight-0 rows leave both numerator and denominator
        B, T, old, delta, mask, adv, w = batch
        num, den = self._reference_objective(B, T, old, delta, mask, adv, w)
        assume(den > 0)
        old_t = torch.tensor(old, dtype=torch.float64).view(B, T)
        logp_t = old_t + torch.tensor(delta, dtype=torch.float64).view(B, T)
        loss, metrics = clipped_policy_loss(
            logp_t,
            old_t,
            torch.tensor(adv, dtype=torch.float64),
            torch.tensor(w, dtype=torch.float64),
            torch.tensor(mask).view(B, T),
        )
        assert float(loss) == pytest.approx(-num / den, rel=1e-9, abs=1e-12)
        assert float(metrics["tokens"]) == den


# --------------------------------------------------------------------------------------------
# Section 2.2: peer-last minibatch order
# --------------------------------------------------------------------------------------------


def _lists(chunks: list[torch.Tensor]) -> list[list[int]]:
    return [c.tolist() for c in chunks]


class TestMinibatchOrder:
    def test_last(self):
        # own = 0, 2, 3, 5; peer = 1, 4 -> [0, 2, 3, 5, 1, 4] in chunks of 2
        is_peer = _bool([0, 1, 0, 0, 1, 0])
        got = minibatch_order(is_peer, 2, "last")
        assert _lists(got) == [[0, 2], [3, 5], [1, 4]]
        assert all(c.dtype == torch.long for c in got)

    def test_last_is_default(self):
        is_peer = _bool([1, 0, 0, 1, 0])
        # own = 1, 2, 4; peer = 0, 3 -> [1, 2, 4, 0, 3]: chunks [1, 2], [4, 0], [3]
        assert _lists(minibatch_order(is_peer, 2)) == [[1, 2], [4, 0], [3]]

    def test_first(self):
        is_peer = _bool([0, 1, 0, 0, 1, 0])
        # peer = 1, 4 first, then own = 0, 2, 3, 5; chunks of 4
        assert _lists(minibatch_order(is_peer, 4, "first")) == [[1, 4, 0, 2], [3, 5]]

    def test_empty(self):
        assert minibatch_order(torch.zeros(0, dtype=torch.bool), 2, "last") == []
        assert minibatch_order(torch.zeros(0, dtype=torch.bool), 2, "first") == []
        assert minibatch_order(torch.zeros(0, dtype=torch.bool), 2, "uniform") == []

    def test_minibatch_larger_than_batch(self):
        is_peer = _bool([1, 0, 0])
        assert _lists(minibatch_order(is_peer, 8, "last")) == [[1, 2, 0]]
        assert _lists(minibatch_order(is_peer, 8, "first")) == [[0, 1, 2]]

    def test_all_own_or_all_peer(self):
        assert _lists(minibatch_order(_bool([0, 0, 0]), 2)) == [[0, 1], [2]]
        assert _lists(minibatch_order(_bool([1, 1, 1]), 2)) == [[0, 1], [2]]

    def test_invalid_arguments(self):
        with pytest.raises(ValueError):
            minibatch_order(_bool([0, 1]), 0)
        with pytest.raises(ValueError):
            minibatch_order(_bool([0, 1]), 1, "middle")  # type: ignore[arg-type]

    def test_uniform_is_permutation_of_own_first_chunks(self):
        is_peer = _bool([1, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0])  # 16 groups, 8 chunks
        reference = _lists(minibatch_order(is_peer, 2, "last"))
        seen = set()
        for seed in range(6):
            got = _lists(
                minibatch_order(is_peer, 2, "uniform", generator=torch.Generator().manual_seed(seed))
            )
            assert sorted(got) == sorted(reference)
            again = _lists(
                minibatch_order(is_peer, 2, "uniform", generator=torch.Generator().manual_seed(seed))
            )
            assert got == again  # same seed, same order
            seen.add(tuple(map(tuple, got)))
        assert len(seen) > 1  # the order depends on the seed

    @PROPERTY
    @given(
        flags=st.lists(st.booleans(), min_size=1, max_size=40),
        g=st.integers(1, 12),
        position=st.sampled_from(["last", "first"]),
    )
    def test_property_order(self, flags, g, position):
        # (6) every index exactly once; no pure-own (resp. pure-peer for "first") minibatch after
        # one that holds a peer (resp. own) group; chunks are full except the last.
        is_peer = _bool(flags)
        chunks = _lists(minibatch_order(is_peer, g, position))
        flat = [i for c in chunks for i in c]
        assert sorted(flat) == list(range(len(flags)))
        assert all(len(c) == g for c in chunks[:-1])
        assert all(len(c) > 0 for c in chunks)
        late = position == "last"  # the kind that must come late is peer for "last", own for "first"
        seen_late = False
        for c in chunks:
            has_late = any(flags[i] == late for i in c)
            if seen_late:
                assert has_late, "a purely early-kind minibatch came after a late-kind one"
            seen_late = seen_late or has_late


# --------------------------------------------------------------------------------------------
# k3 KL estimator and NLL (reference-policy penalty, SGT's supervised term)
# --------------------------------------------------------------------------------------------
def test_k3_kl_hand_values():
    from graftrl.core import k3_kl

    logp = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.25)]])
    mask = torch.tensor([[True, True]])
    # d = log(0.25/0.5) = -ln 2 on the first token, 0 on the second: k3 = 0.5 + ln 2 - 1 and 0.
    expected = (0.5 + math.log(2) - 1.0) / 2
    assert float(k3_kl(logp, ref, mask)) == pytest.approx(expected, rel=1e-6)
    assert float(k3_kl(logp, logp, mask)) == 0.0
    assert float(k3_kl(logp, ref, mask, normalizer=4)) == pytest.approx(expected / 2, rel=1e-6)


def test_nll_loss_is_token_mean():
    from graftrl.core import nll_loss

    logp = torch.tensor([[-1.0, -2.0, -9.0], [-3.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert float(nll_loss(logp, mask)) == pytest.approx(2.0)


# --------------------------------------------------------------------------------------------
# GRAFT among K > 2 models (graftrl's extension; K = 2 must be the paper exactly)
# --------------------------------------------------------------------------------------------
@settings(max_examples=75, deadline=None)
@given(
    k=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=12),
    balance=st.booleans(),
)
def test_multi_source_selection_with_two_models_is_balanced_selection(k, balance):
    from graftrl.core import multi_source_selection

    successes = torch.tensor(k).T  # [2, P]
    chosen = multi_source_selection(successes, 4, balance)
    a_to_b, b_to_a = balanced_selection(successes[0], successes[1], 4, balance=balance)
    assert torch.equal(chosen[1] == 0, a_to_b) and torch.equal(chosen[0] == 1, b_to_a)
    assert bool(((chosen == -1) | (chosen == torch.tensor([[1], [0]]))).all())


def test_multi_source_selection_three_models_by_hand():
    from graftrl.core import multi_source_selection

    # n = 4; rows are models 0, 1, 2; columns prompts 0..3
    successes = torch.tensor([[0, 0, 3, 0], [2, 0, 0, 1], [3, 1, 0, 0]])
    # unbalanced: each all-fail receiver takes its best mixed source (ties -> lower index)
    assert multi_source_selection(successes, 4, balance=False).tolist() == [
        [2, 2, -1, 1],
        [-1, 2, 0, -1],
        [-1, -1, 0, 1],
    ]
    # balanced per pair: {0,2} has C_2->0 = {0, 1} and C_0->2 = {2}, so m = 1 keeps prompt 0 (k = 3)
    assert multi_source_selection(successes, 4, balance=True).tolist() == [
        [2, -1, -1, 1],
        [-1, 2, 0, -1],
        [-1, -1, 0, 1],
    ]
    # a receiver never takes a group where it succeeded, nor an all-pass / all-fail source group
    chosen = multi_source_selection(torch.tensor([[4, 0], [2, 0], [0, 0]]), 4, balance=False)
    assert chosen.tolist() == [[-1, -1], [-1, -1], [1, -1]]


# ----- truncated importance sampling (rollout/trainer mismatch) ----------------------------------
def test_truncated_is_weights_by_hand():
    trainer = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    rollout = torch.log(torch.tensor([[0.25, 0.4, 0.9]]))
    # ratios 2.0, 0.5, 1.0; the cap 1.5 truncates the first
    expected = torch.tensor([[1.5, 0.5, 1.0]])
    assert torch.allclose(truncated_is_weights(trainer, rollout, cap=1.5), expected)
    assert not truncated_is_weights(trainer.requires_grad_(), rollout, 1.5).requires_grad


def test_clipped_loss_token_weights_scale_each_token():
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.3, 0.3]]))
    old = logp.clone()  # ratio 1: every token's surrogate equals its advantage
    advantages = torch.tensor([1.0, -2.0])
    weights = torch.ones(2)
    mask = torch.tensor([[1, 1], [1, 0]])
    token_weights = torch.tensor([[2.0, 0.5], [1.5, 9.0]])  # the masked token's 9 must not count
    loss, _ = clipped_policy_loss(logp, old, advantages, weights, mask, token_weights=token_weights)
    # J = (1*2 + 1*0.5 - 2*1.5) / 3 tokens
    assert loss.item() == pytest.approx(-(2.0 + 0.5 - 3.0) / 3)
    plain, _ = clipped_policy_loss(logp, old, advantages, weights, mask)
    ones, _ = clipped_policy_loss(logp, old, advantages, weights, mask, token_weights=torch.ones(2, 2))
    assert plain.item() == pytest.approx(ones.item())
