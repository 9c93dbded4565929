"""Pure tensor functions of GRPO/GRAFT, as docs/algorithm.md states them: no models, no I/O.

P prompts, n rollouts per prompt, B responses, T tokens. One module per piece of math:
``advantages`` (eq. 1), ``selection`` (which groups move, eq. 4), ``compatibility`` (s, w; eqs.
6-8), ``losses`` (the clipped surrogate, eqs. 2, 3, 9, 10), ``logprobs`` (log-probs a chunk at a
time), ``schedule`` (groups across optimizer steps), ``contrast`` (what a moved group can teach),
``diagnostics`` (per-step diagnostics), ``pooling`` (eq. 12), ``ablations`` (GRAFT's ablation
switches) and the other methods' pieces: ``hacpo``, ``sgt``, ``luffy``, ``hint`` (the
rescue round's sources and advantages).
"""

from graftrl.core.advantages import SUCCESS_THRESHOLD, grpo_advantages, is_success
from graftrl.core.compatibility import (
    compatibility_score,
    compatibility_weight,
    content_mean_logprob,
    mean_token_logprob,
)
from graftrl.core.diagnostics import (
    all_fail_signal_fraction,
    complementarity,
    group_outcome_fractions,
    weight_summary,
)
from graftrl.core.hacpo import (
    capability_baseline,
    capability_ratios,
    content_mask,
    gspo_own_terms,
    hacpo_advantages,
    hacpo_peer_terms,
    pooled_minibatch_order,
    stepwise_lower_bound,
)
from graftrl.core.logprobs import chunked_token_logprobs, token_logprobs
from graftrl.core.losses import (
    clipped_policy_loss,
    clipped_token_mask,
    k3_kl,
    k3_sums,
    nll_loss,
    truncated_is_weights,
)
from graftrl.core.schedule import PeerPosition, minibatch_order
from graftrl.core.selection import (
    balanced_selection,
    multi_source_selection,
    select_with_ties,
    transfer_candidates,
)

__all__ = [
    "SUCCESS_THRESHOLD",
    "PeerPosition",
    "all_fail_signal_fraction",
    "balanced_selection",
    "capability_baseline",
    "capability_ratios",
    "chunked_token_logprobs",
    "clipped_policy_loss",
    "clipped_token_mask",
    "compatibility_score",
    "compatibility_weight",
    "complementarity",
    "content_mask",
    "content_mean_logprob",
    "group_outcome_fractions",
    "grpo_advantages",
    "gspo_own_terms",
    "hacpo_advantages",
    "hacpo_peer_terms",
    "is_success",
    "k3_kl",
    "k3_sums",
    "mean_token_logprob",
    "minibatch_order",
    "multi_source_selection",
    "nll_loss",
    "pooled_minibatch_order",
    "select_with_ties",
    "stepwise_lower_bound",
    "token_logprobs",
    "transfer_candidates",
    "truncated_is_weights",
    "weight_summary",
]
