"""``method: hint``: CoRe's rescue round (arXiv 2601.21600; algorithm.md §3.1) — the peer in the
receiver's prompt, not in its gradient.

On a prompt where the receiver failed all n (eq. 4's k_B = 0) and a peer (co-trained or stored)
has a verified success, the receiver samples n responses again with a hint built from one of the
peer's successful responses in its prompt. The rescued group replaces the all-fail group and
trains with GRPO advantages of its own rewards (``core.hint.rescued_advantages``). Nothing of the
peer enters the loss: every row is the receiver's own sample.

The method owns the text of the hint (``hint_text``, ``hinted_problem``) and which prompts are
rescued (``rescue_targets``); the trainer runs the round between rollout and plan
(``graftrl.training.rescue``), each receiver's worker fits the hint to its context and samples.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from graftrl.core.advantages import is_success
from graftrl.core.hint import NO_PEER, rescue_sources, rescued_advantages
from graftrl.methods.base import (
    ClippedSurrogate,
    ConfigSection,
    ExchangePlan,
    GroupOutcomes,
    RescueTarget,
    own_groups,
    register_method,
)
from graftrl.methods.loss_metrics import PlanKey

HintForm = Literal["plan", "prefix", "solution"]

DEFAULT_TEMPLATE = "{problem}\nHint: {hint}\n"
"""Where the hint goes: appended to the problem (its suffix included), before the policy's own
template or chat template wraps it, so every model and tokenizer reads it the same way."""

_BOX = re.compile(r"\\(?:boxed|fbox)\b")
_SENTENCE_END = re.compile(r"[.;\n]")


class HintConfig(ConfigSection):
    """CoRe's rescue round (`method: hint`): the receiver's all-fail prompts that a peer solved are
    sampled again with a hint from the peer's successful response in the prompt (ignored by
    other methods)."""

    form: HintForm = "plan"
    """What of the peer's successful response the hint holds: plan (its reasoning without the
    final answer: the text before the last \\boxed, cut back to the sentence before it; default),
    prefix (its first `fraction` of characters) or solution (all of it, answer included)."""
    fraction: float = Field(default=0.5, gt=0, le=1)
    """Share of the response's characters a `prefix` hint holds (only with form: prefix)."""
    template: str = DEFAULT_TEMPLATE
    """The hinted problem: must hold {problem} and {hint}; the policy's own template or chat
    template then wraps it like any problem."""
    condition: Literal["hinted", "original"] = "hinted"
    """What the gradient conditions on: hinted (the rows' prompt is the hinted one the responses
    were sampled from: on-policy, CoRe's choice; default) or original (the rows' prompt is the
    problem without the hint, the hinted sampling's log-probs the ratio's denominator:
    off-policy, algorithm.md §3.1)."""
    rescue_bonus: float = Field(default=0.0, ge=0)
    """Added to the advantage of each successful rescued response (CoRe's rescue bonus); 0 = off."""

    @model_validator(mode="after")
    def _check_template(self) -> HintConfig:
        for field in ("{problem}", "{hint}"):
            if field not in self.template:
                raise ValueError(f"template: must hold {field} (got {self.template!r})")
        try:
            self.template.format(problem="", hint="")
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(f"template: only {{problem}} and {{hint}} may be fields ({error})") from None
        return self


def hint_text(response: str, form: HintForm, fraction: float = 0.5) -> str:
    """The hint a successful response gives: see ``HintConfig.form``. A ``plan`` of a response
    with no \\boxed answer is the response without its last line (where an answer usually is)."""
    text = response.strip()
    if form == "solution":
        return text
    if form == "prefix":
        return text[: math.ceil(fraction * len(text))].rstrip()
    boxes = list(_BOX.finditer(text))
    if boxes:
        head = text[: boxes[-1].start()]
        ends = list(_SENTENCE_END.finditer(head))
        return (head[: ends[-1].end()] if ends else head).strip()
    lines = text.splitlines()
    return "\n".join(lines[:-1]).strip()


def hinted_problem(template: str, problem: str, hint: str) -> str:
    """The problem text the receiver samples from in the rescue round."""
    return template.format(problem=problem, hint=hint)


PLAN_KEYS = (
    PlanKey(
        "rescue_attempted",
        "prompts the policy failed entirely that a peer solved, sampled again with a hint (hint)",
        "prompts",
    ),
    PlanKey("rescue_solved", "of them, prompts solved at least once with the hint (hint)", "prompts"),
    PlanKey("rescue_rate", "rescue_solved / rescue_attempted (hint)", "share"),
    PlanKey("rescue_reward_mean", "mean reward of the responses sampled with a hint (hint)", "reward"),
    PlanKey("rescue_truncated", "hints cut to fit the policy's context (hint)", "prompts"),
    PlanKey(
        "rescue_skipped", "rescues dropped: not even a one-character hint fit the context (hint)", "prompts"
    ),
    PlanKey("rescue/<source>", "prompts rescued with a hint from <source> (hint)", "prompts"),
)
"""The rescue round's diagnostics (logged with the plan's)."""


@register_method("hint")
class Hint(ClippedSurrogate):
    """GRPO on own groups, where the all-fail groups a peer solved are replaced by a rescue round
    sampled with the peer's hint in the prompt (CoRe)."""

    section = HintConfig
    options: HintConfig
    trains_on_stored_peers = True
    plan_keys = PLAN_KEYS
    needs_peer_old_logprobs = False
    scores_peers = False

    @classmethod
    def check(cls, config: Any) -> None:
        super().check(config)
        if len(config.policies) + len(config.peers) < 2:
            raise ValueError(f"method {cls.name!r} needs a peer: two policies, or a policy and `peers:`")
        parallel = [p.name for p in config.policies if p.parallel.data > 1]
        if parallel:
            raise ValueError(
                f"policies[{parallel[0]}].parallel.data: method {cls.name!r} samples a rescue round on "
                "one rank per policy; set parallel.data: 1"
            )
        if config.hint.condition == "original" and config.rollout.tis_cap is not None:
            raise ValueError(
                "rollout.tis_cap: with hint.condition: original the ratio's denominator is the hinted "
                "sampling's log-prob, which the trainer's re-scored old log-probs would replace; remove "
                "rollout.tis_cap or set hint.condition: hinted"
            )

    # ----- the rescue round (driver) ---------------------------------------------------------------
    def rescue_targets(
        self,
        receiver: str,
        outcomes: Mapping[str, GroupOutcomes],
        records: Mapping[str, Sequence[Any]],
    ) -> list[RescueTarget]:
        """The receiver's rescued prompts this step, from every other model's groups (co-trained
        or stored): the peer with the most successes, its first successful response."""
        peers = [name for name in outcomes if name != receiver]
        if not peers:
            return []
        mine = outcomes[receiver]
        stacked = torch.stack([outcomes[p].successes for p in peers])  # [K, P]
        chosen = rescue_sources(mine.successes, stacked)  # [P]
        targets = []
        for prompt in (chosen != NO_PEER).nonzero().flatten().tolist():
            source = peers[int(chosen[prompt])]
            threshold = outcomes[source].success_threshold
            rewards = outcomes[source].rewards[prompt]  # [n]
            response = int(is_success(rewards, threshold).nonzero()[0, 0])
            record = records[source][prompt * mine.n + response]
            assert is_success(record.reward, threshold), "records out of step"
            targets.append(RescueTarget(prompt, source, response))
        return targets

    def hint_for(self, response: str) -> str:
        """The hint a peer's successful response gives (``form``, ``fraction``)."""
        return hint_text(response, self.options.form, self.options.fraction)

    def rescued_outcomes(
        self, outcomes: GroupOutcomes, prompts: Sequence[int], rewards: torch.Tensor
    ) -> GroupOutcomes:
        """The receiver's groups with the rescued ones (prompts [R], their rewards [R, n]) replaced."""
        if not prompts:
            return outcomes
        index = torch.tensor(list(prompts), dtype=torch.long)
        new_rewards, advantages = outcomes.rewards.clone(), outcomes.advantages.clone()
        new_rewards[index] = rewards.float()
        advantages[index] = rescued_advantages(
            rewards,
            self.options.rescue_bonus,
            self.train.adv_eps,
            self.train.adv_std_unbiased,
            outcomes.success_threshold,
        )
        return replace(outcomes, rewards=new_rewards, advantages=advantages)

    # ----- the step ----------------------------------------------------------------------------
    def plan(
        self, outcomes: Mapping[str, GroupOutcomes], generator: torch.Generator
    ) -> dict[str, ExchangePlan]:
        """Every model trains on its own groups, the rescued ones among them (their advantages are
        already the rescue round's); stored peers are not receivers (the trainer asks only for
        the policies' plans)."""
        return {receiver: ExchangePlan(groups=own_groups(receiver, o)) for receiver, o in outcomes.items()}
