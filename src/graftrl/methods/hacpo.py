"""HACPO: K agents train on every agent's rollouts, with capability-aware corrections (algorithm.md §3).

Zhang et al. 2026 (arXiv 2603.02604), as algorithm.md §3 states it and the review
(``papers/hacpo-deep-dive.txt``) describes it:

- **Capability tracker.** P_hat^(k) = mean of agent k's per-step mean reward over the last
  ``window`` (5) steps, the current step included (the review's eq. 9: the window t-K+1..t);
  omega^(k,j) = clip(P_hat^(k) / P_hat^(j), 0.1, 10). It updates in ``plan`` and is the method's
  checkpointed state. Undefined ratios mean "equally capable": before any step (empty window)
  and for 0 / 0, omega = 1; x / 0 clips to 10 and 0 / x to 0.1.
- **Capability-aware advantage** for learner k over the pooled K*n responses of a prompt:
  mu^(k) = mean_i omega^(k, src_i) r_i, A = (r - mu^(k)) / (std_joint + eps), the same A for own
  and peer responses; uniform pooled groups get A = 0; mu^(k) > 1 falls back to k's own group
  mean. Every agent trains on every prompt's pooled group: its own group plus one peer group
  (``peer=True``) per other agent, all with advantages A^(k).
- **Own responses (J_homo):** GSPO, s = exp(mean_t log rho_t) over the receiver's own tokens
  (EOS included, as GSPO's response mask), term min(s A, clip(s, 1 - 3e-4, 1 + 4e-4) A).
- **Peer responses (J_hete):** s^(k,j) = exp(lbar(pi_theta^k, y^k) - lbar(pi_old^j, y^j)), the
  current receiver on its own re-tokenization (content tokens: terminal EOS excluded on both
  sides, as the compatibility score) against the source's behaviour mean from the record;
  c = clip(s, lower_m, 1), lower_m = min(1, 0.8 + 0.025 m) at optimizer step m of the rollout
  step (``RowOrigins.minibatch_index``); term c * sg(c)^alpha * omega^(j,k) * A, alpha = 1.
  The source mean reaches the loss as ``RowOrigins.source_mean_logp`` (``reads_row_origins``:
  the worker copies the record's ``mean_logprob`` per row), so ``peer_weights`` is 1 for every
  peer response: HACPO
  has no compatibility gate. No PPO min on the peer term (the review: cross-agent ratios do not
  drift monotonically).
- **Capability coefficient.** The review's "Model Capabilities Discrepancy Coefficient" (its
  eq. 10, section 3.2) *is* omega^(j,k) = P_hat^(j) / P_hat^(k) on the peer term; there is no
  further coefficient beyond it.
- **KL** to the frozen initial policy with the k3 estimator on own responses only: the
  trainer's ``train.kl_coef`` (the recipe's ``KL_COEF`` unless the config sets it, ``recipe``)
  gives ``ref_logp``; this loss adds it.
- **Aggregation** (``hacpo.loss_agg``). "seq-mean" (default): the review writes both terms as
  sequence means (eqs. 47-53, 1/G sum_i); HACPO runs on verl's GSPO, whose loss is a sequence
  mean over the minibatch's rows. So the loss of a minibatch is
  -(sum of own and peer row terms) / (rows in the minibatch) + kl_coef * (sum over own rows of
  their token-mean k3) / (rows in the minibatch). With pooled minibatches (K*n rows per prompt)
  this is eq. 53 averaged over the minibatch's prompts divided by K, a constant factor.
  "token-mean": each row's sequence term counts once per response token, over the minibatch's
  token count (k3 token-mean over the same count), as ClippedSurrogate.
- **Minibatches.** A minibatch holds whole prompts: each prompt's own and peer groups go into
  the same optimizer step (``order_minibatches``; Algorithm 1 computes J_homo and J_hete on
  the same mini-batch subset). Its size is the recipe's: verl's ``ppo_mini_batch_size`` of 64
  prompts means 64 x n rows, so over the pooled batch of 128 prompts x K groups x n rows an
  agent takes K x 128 / 64 = 4 optimizer steps at K = 2 (``hacpo.minibatch: rows``, each step
  ``train.minibatch_prompts / K`` prompts with all their groups); ``hacpo.minibatch: prompts``
  packs ``train.minibatch_prompts`` whole prompts per step (2 steps), as graftrl did before.

Where the review and docs/algorithm.md differ, this follows docs/algorithm.md and offers the
review as a switch: the peer lower bound (algorithm.md: 0.8 + 0.025 m; the review's 1 - delta + m delta_step = 0.2 +
0.025 m is ``hacpo.clip_lower: 0.2``), the reweighting base (algorithm.md: sg(c)^alpha; the review's
sg(s)^alpha for s < 1 is ``hacpo.exp_ratio: raw``), and the peer advantage (algorithm.md and the
review's eq. 53 use the learner's A^(k); the review's eq. 10 writes the source's A^(j)).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from graftrl.core import (
    capability_baseline,
    capability_ratios,
    content_mask,
    gspo_own_terms,
    hacpo_advantages,
    hacpo_peer_terms,
    k3_kl,
    k3_sums,
    stepwise_lower_bound,
)
from graftrl.core.hacpo import ALPHA, CLIP_LOWER, CLIP_STEP, OMEGA_MAX, OMEGA_MIN, OWN_CLIP_HIGH, OWN_CLIP_LOW
from graftrl.methods.base import (
    ConfigSection,
    ExchangePlan,
    GroupOutcomes,
    LossInputs,
    Method,
    TrainGroup,
    TrainSettings,
    WholePromptMinibatches,
    register_method,
)
from graftrl.methods.loss_metrics import CLIPPING, KL, OWN_S, PEER_S, LossMetric, PlanKey

KL_COEF = 1e-3
"""The recipe's ``train.kl_coef`` (algorithm.md §3): what ``method: hacpo`` trains with unless the
config sets it (``HACPO.recipe``)."""
MINIBATCH_SHARE = 2
"""The recipe's minibatch is 1 / this of the prompt batch (verl's 64 of 128 prompts): what
``train.minibatch_prompts`` is for ``method: hacpo`` unless the config sets it."""


class HacpoConfig(ConfigSection):
    """HACPO settings (ignored by other methods). Unless the config sets them, `method: hacpo` also
    takes its recipe's `train.kl_coef` (1e-3) and `train.minibatch_prompts` (half of
    `train.batch_prompts`, a multiple of the policies), not the section defaults."""

    window: int = Field(default=5, ge=1)
    """Steps in the sliding window of per-step mean rewards that estimates each agent's capability."""
    omega_min: float = Field(default=OMEGA_MIN, gt=0)
    """Lower clip of the capability ratio omega^(k,j) = P_hat^(k) / P_hat^(j)."""
    omega_max: float = Field(default=OMEGA_MAX, gt=0)
    """Upper clip of the capability ratio omega^(k,j)."""
    own_clip_low: float = Field(default=OWN_CLIP_LOW, ge=0)
    """GSPO clip of own responses' sequence ratio: lower range (clip(s, 1 - low, 1 + high))."""
    own_clip_high: float = Field(default=OWN_CLIP_HIGH, ge=0)
    """GSPO clip of own responses' sequence ratio: upper range."""
    clip_lower: float = Field(default=CLIP_LOWER, ge=0, le=1)
    """Peer ratio clip [lower_m, 1]: lower_m = min(1, clip_lower + clip_step * m) at minibatch m."""
    clip_step: float = Field(default=CLIP_STEP, ge=0)
    """Per-minibatch tightening of the peer clip's lower bound (stepwise clipping)."""
    alpha: float = Field(default=ALPHA, ge=0)
    """Exponent of the stop-gradient reweighting c * sg(c)^alpha of peer responses."""
    exp_ratio: Literal["clipped", "raw"] = "clipped"
    """Ratio inside sg(.)^alpha: the clipped c (algorithm.md) or the raw min(s, 1) (the review's eq. 53)."""
    loss_agg: Literal["seq-mean", "token-mean"] = "seq-mean"
    """Minibatch average of the sequence-level terms: over rows (GSPO) or weighted by token count."""
    minibatch: Literal["rows", "prompts"] = "rows"
    """Optimizer-step size. "rows" (the official recipe): `train.minibatch_prompts` x n rows of the
    pooled K x n-row groups, i.e. minibatch_prompts / K prompts with all their groups per step (128
    prompts, 64-prompt minibatches, K = 2: 4 optimizer steps). "prompts": minibatch_prompts whole
    prompts (K x n rows each) per step (graftrl before 0.2: 2 steps at the same sizes)."""


PEER_LOWER_BOUND = LossMetric(
    "peer_lower_bound",
    "peer_lower_bound_sum",
    "peer_rows",
    "mean over the peer rows trained of the lower bound lower_m of their ratio clip [lower_m, 1] "
    "(HACPO's stepwise clip: it rises with the optimizer step m)",
    "ratio",
)


PLAN_KEYS = (
    PlanKey(
        "omega/<source>",
        "capability ratio on <source>'s term, clip(P_hat(self) / P_hat(source)) (HACPO)",
        "ratio",
    ),
    PlanKey(
        "capability",
        "P_hat: the policy's mean reward over the capability window (HACPO)",
        "mean reward (0-1)",
    ),
    PlanKey(
        "baseline_fallbacks",
        "prompts whose capability baseline fell back to the own group mean (HACPO)",
        "prompts",
    ),
)


@register_method("hacpo")
class HACPO(WholePromptMinibatches, Method):
    """K >= 2 agents; each trains on every prompt's pooled group with capability corrections.

    ``train.adv_eps`` and ``train.adv_std_unbiased`` (eq. 1) and ``train.kl_coef`` come from the
    ``train`` section; ``history`` is the capability tracker's state."""

    section = HacpoConfig
    loss_metrics = (*CLIPPING, OWN_S, PEER_S, KL, PEER_LOWER_BOUND)  # its peer clip has no sign split
    plan_keys = PLAN_KEYS
    allows_tis = False  # own rows use GSPO's sequence ratio, peer rows the source's behaviour mean
    needs_peer_old_logprobs = False  # the peer term compares with the source's mean (the record)
    # Peers are still scored: s is the peer ratio at the first optimizer step (compatibility.jsonl).
    reads_row_origins = True  # omega per source, the source's mean, the stepwise clip, seq-mean rows
    options: HacpoConfig

    def __init__(
        self,
        options: HacpoConfig | None = None,
        /,
        *,
        train: TrainSettings | None = None,
        history: dict[str, list[float]] | None = None,
        **fields: Any,
    ) -> None:
        super().__init__(options, train=train, **fields)
        self.history: dict[str, list[float]] = {} if history is None else history
        """Per agent, its per-step mean rewards of the last ``window`` steps (oldest first)."""

    @classmethod
    def recipe(cls, batch_prompts: int, policies: int) -> dict[str, Any]:
        """KL 1e-3 and a minibatch of half the prompt batch (rounded down to a multiple of the
        agents, at least one prompt each): the official recipe (``KL_COEF``, ``MINIBATCH_SHARE``)."""
        share = batch_prompts // MINIBATCH_SHARE
        return {"kl_coef": KL_COEF, "minibatch_prompts": max(policies, share - share % max(policies, 1))}

    @classmethod
    def check(cls, config: Any) -> None:
        super().check(config)
        if len(config.policies) < 2:
            raise ValueError(f"method {cls.name!r} needs at least two policies, got {len(config.policies)}")
        agents = len(config.policies)
        options: HacpoConfig = cls.options_of(config)
        if options.minibatch == "rows" and config.train.minibatch_prompts % agents:
            raise ValueError(
                f"train.minibatch_prompts ({config.train.minibatch_prompts}) must be a multiple of the "
                f"{agents} agents with hacpo.minibatch: rows (each step takes minibatch_prompts x n "
                "rows = whole prompts' pooled groups); change it or set hacpo.minibatch: prompts"
            )

    def order_minibatches(
        self, plan: ExchangePlan, prompts_per_minibatch: int, generator: torch.Generator
    ) -> list[Tensor]:
        if self.options.minibatch == "rows":  # minibatch_prompts x n rows of pooled K x n-row prompts
            agents = len({g.source for g in plan.groups})
            prompts_per_minibatch = max(1, prompts_per_minibatch // agents)
        return super().order_minibatches(plan, prompts_per_minibatch, generator)

    # ----- capability tracker ---------------------------------------------------------------
    def observe(self, mean_rewards: Mapping[str, float]) -> None:
        """Push one step's mean reward per agent into the sliding windows."""
        for agent, value in mean_rewards.items():
            window = self.history.setdefault(agent, [])
            window.append(float(value))
            del window[: -self.options.window]

    def capability(self, agent: str) -> float:
        """P_hat of ``agent``: the mean of its window; NaN before any step."""
        window = self.history.get(agent, [])
        return sum(window) / len(window) if window else math.nan

    def omega(self, agents: list[str]) -> Tensor:
        """[K, K] omega^(k,j) = clip(P_hat^(k) / P_hat^(j)) for ``agents`` in that order."""
        p_hat = torch.tensor([self.capability(a) for a in agents], dtype=torch.float64)
        return capability_ratios(p_hat, self.options.omega_min, self.options.omega_max)

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.options.window, "history": {a: list(w) for a, w in self.history.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:  # a checkpoint without method state: start the tracker afresh
            self.history = {}
            return
        unknown = set(state) - {"window", "history"}
        if unknown:
            raise ValueError(f"HACPO state has unknown keys {sorted(unknown)}")
        self.history = {
            str(a): [float(x) for x in w][-self.options.window :] for a, w in state["history"].items()
        }

    # ----- plan -----------------------------------------------------------------------------
    def plan(
        self, outcomes: Mapping[str, GroupOutcomes], generator: torch.Generator
    ) -> dict[str, ExchangePlan]:
        agents = self.models_of(outcomes, "HACPO needs at least two agents, got {count}")
        self.observe({a: float(outcomes[a].rewards.float().mean()) for a in agents})
        omega = self.omega(agents)
        rewards = torch.stack([outcomes[a].rewards.float() for a in agents])  # [K, P, n]
        plans: dict[str, ExchangePlan] = {}
        for k, receiver in enumerate(agents):
            advantages = hacpo_advantages(
                rewards, omega[k], k, self.train.adv_eps, self.train.adv_std_unbiased
            )
            _, fell_back = capability_baseline(rewards, omega[k], k)
            order = [k] + [j for j in range(len(agents)) if j != k]
            groups = [
                TrainGroup(prompt=p, source=agents[j], peer=j != k, advantages=advantages[j, p])
                for p in range(rewards.shape[1])
                for j in order
            ]
            diagnostics = {
                "capability": self.capability(receiver),
                "baseline_fallbacks": float(fell_back.sum()),
            }
            for j, source in enumerate(agents):
                if j != k:
                    diagnostics[f"omega/{source}"] = float(omega[j, k])  # on the peer term
            plans[receiver] = ExchangePlan(groups=groups, diagnostics=diagnostics)
        return plans

    # ----- loss -----------------------------------------------------------------------------
    def loss(self, batch: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        logp = batch.logp
        device = logp.device
        mask = batch.mask.bool()
        kept = batch.weights > 0
        is_peer = batch.is_peer.bool() & kept
        is_own = ~batch.is_peer.bool() & kept
        if batch.is_nll is not None and bool(batch.is_nll.any()):
            raise ValueError("HACPO plans no NLL groups")
        origins = batch.origins
        if origins is None:
            raise ValueError("HACPO reads LossInputs.origins (reads_row_origins); the batch has none")

        own_term, own_s, own_clipped = gspo_own_terms(
            logp,
            batch.old_logp,
            batch.advantages,
            mask,
            self.options.own_clip_low,
            self.options.own_clip_high,
        )
        terms = torch.where(is_own, own_term, torch.zeros_like(own_term))
        peer_clipped = torch.zeros_like(is_peer)
        peer_s = torch.zeros_like(own_s)
        lower = stepwise_lower_bound(origins.minibatch_index, self.options.clip_lower, self.options.clip_step)
        if bool(is_peer.any()):
            agents = sorted(set(origins.sources) | {origins.receiver})
            omega = self.omega(agents)
            receiver = agents.index(origins.receiver)
            # omega^(j,k) = P_hat^(j) / P_hat^(k): source j over learner k.
            row_omega = torch.tensor(
                [float(omega[agents.index(src), receiver]) for src in origins.sources], device=device
            )
            peer_term, peer_s, peer_clipped = hacpo_peer_terms(
                logp,
                origins.source_mean_logp.to(device),
                batch.advantages,
                row_omega,
                content_mask(mask, origins.finished),
                lower,
                self.options.alpha,
                self.options.exp_ratio,  # type: ignore[arg-type]
            )
            terms = torch.where(is_peer, peer_term, terms)

        lengths = mask.sum(dim=-1).to(logp.dtype)
        if self.options.loss_agg == "seq-mean":
            denominator = float(origins.minibatch_rows)
            loss = -terms.sum() / denominator
            kl_mask = (mask & is_own.unsqueeze(-1)).to(logp.dtype) / lengths.clamp(min=1).unsqueeze(-1)
        else:
            denominator = float(batch.normalizer)
            loss = -(terms * lengths).sum() / denominator
            kl_mask = (mask & is_own.unsqueeze(-1)).to(logp.dtype)

        with torch.no_grad():
            zero = own_s.new_zeros(())
            metrics: dict[str, Tensor] = {
                "own_clipped_tokens": (lengths * (own_clipped & is_own)).sum(),
                "peer_clipped_tokens": (lengths * (peer_clipped & is_peer)).sum(),
                "own_rows": is_own.sum().float(),
                "own_s_sum": torch.where(is_own, own_s, zero).sum(),
                "peer_rows": is_peer.sum().float(),
                "peer_s_sum": torch.where(is_peer, peer_s, zero).sum(),
                "peer_lower_bound_sum": lower * is_peer.sum().float(),
            }
        if batch.ref_logp is not None and self.train.kl_coef > 0:
            kl = k3_kl(logp, batch.ref_logp, kl_mask, normalizer=denominator)
            loss = loss + self.train.kl_coef * kl
            # the token-mean over own tokens whatever loss_agg weighs them with
            metrics["kl_sum"], metrics["kl_tokens"] = k3_sums(
                logp, batch.ref_logp, mask & is_own.unsqueeze(-1)
            )
        return loss, metrics
