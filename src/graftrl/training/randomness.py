"""Every random draw of a run comes from a seed derived from (run seed, step, stream).

No generator carries state from one step to the next, so weights, optimizer state and the step
number are the whole state of a run (exact resume), and the draws do not depend on the order in
which workers run (the local and the Ray backend give the same results).
"""

from __future__ import annotations


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """A seed derived from (run seed, step, stream): randomness needs no state to resume."""
    return (seed * 1_000_003 + step * 7_919 + stream * 104_729) % (2**63 - 1)


PLAN_STREAM = 0
"""The method's plan (the driver)."""


def sampling_stream(index: int, round_: int = 0) -> int:
    """Policy ``index``'s sampling in dynamic-sampling round ``round_`` (0: the shared batch)."""
    return 1 + index + 1000 * round_


UPDATE_STREAM = 500_000
"""UPDATE_STREAM + policy index: a policy's update (minibatch order, random admission)."""
RESCUE_STREAM = 700_000
"""RESCUE_STREAM + policy index: a policy's rescue round (``method: hint``)."""
EXTRA_PROMPT_STREAM = 999_983
"""Dynamic sampling's extra prompts (one sampler per policy, a slot per (step, policy, round))."""
