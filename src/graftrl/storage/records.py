"""The tokenizer-neutral record: the only thing that crosses from one model to another."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class TrajectoryRecord:
    """One sampled response, described without reference to any tokenizer's ids.

    A receiver re-tokenizes ``response`` with its own tokenizer; the compatibility score only
    needs the source's mean token log-prob (eq. 6), which is stored here.
    """

    prompt_id: str
    """Identifier of the prompt (the data set's ``id``)."""
    step: int
    """Training step at which the response was sampled (0-based, as in metrics.jsonl)."""
    source: str
    """Name of the model that sampled it."""
    index: int
    """Position of the response within its group (0..n-1)."""
    response: str
    """Response text, decoded without special tokens."""
    reward: float
    """Verifier reward in {0, 1}."""
    advantage: float
    """GRPO advantage computed by the source on its full group (eq. 1)."""
    mean_logprob: float
    """Source behaviour policy's mean token log-prob on its own tokenization, EOS excluded."""
    num_tokens: int
    """Source token count, EOS excluded."""
    num_bytes: int
    """UTF-8 byte length of ``response``."""
    finished: bool
    """True when the response ended with EOS (finish reason "stop"); False: cut at the length limit."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
