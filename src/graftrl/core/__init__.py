"""Pure tensor functions of GRPO/GRAFT, as SPEC.md states them: no models, no I/O.

P prompts, n rollouts per prompt, B responses, T tokens.
"""

from graftrl.core.advantages import grpo_advantages
from graftrl.core.compatibility import compatibility_score, compatibility_weight, mean_token_logprob
from graftrl.core.diagnostics import complementarity, group_outcome_fractions
from graftrl.core.losses import clipped_policy_loss, clipped_token_mask, k3_kl, nll_loss
from graftrl.core.schedule import PeerPosition, minibatch_order
from graftrl.core.selection import balanced_selection, select_with_ties, transfer_candidates

__all__ = [
    "PeerPosition",
    "balanced_selection",
    "clipped_policy_loss",
    "clipped_token_mask",
    "compatibility_score",
    "compatibility_weight",
    "complementarity",
    "group_outcome_fractions",
    "grpo_advantages",
    "k3_kl",
    "mean_token_logprob",
    "minibatch_order",
    "nll_loss",
    "select_with_ties",
    "transfer_candidates",
]
