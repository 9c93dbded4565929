"""Served peers for ``GraftGRPOTrainer``: an OpenAI-compatible endpoint answers the all-fail prompts.

No TRL import. ``GraftGRPOTrainer(..., peers=[ServedPeer(endpoint=..., model=..., name=...)])`` sends
the generation batch's prompts on which the receiver failed all n (and only those) to the endpoint
(``graftrl.models.served``: concurrent, bounded, retried, a per-batch timeout), asking for
``num_generations`` completions at the trainer's temperature and top-p, at most
``max_completion_length`` tokens, with token log-probs. The answers become stored rows
(``models.served_groups.served_rows``, as ``graftrl train``); the trainer verifies them with its own reward functions and
gives them eq. 1's advantages within their group (``peer_groups`` with the rewards), then the same
exchange as a stored peer. With ``record_store`` they are recorded beside the receiver's own rows,
so the run can be replayed as a stored peer.

``ServedPeer`` is ``config.peers.ServedPeerConfig``, the settings of ``graftrl train``'s served peers.
The prompt sent is ``template.format(problem=...)`` of the dataset's prompt: the string itself, or
for a conversation the content of its last user message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from graftrl.config.peers import ServedPeerConfig
from graftrl.models.served import RequestStats, SamplingRequest
from graftrl.models.served_groups import COST_KEYS, client_of, served_rows
from graftrl.storage.store import StoredTrajectory

ServedPeer = ServedPeerConfig
"""A model behind an OpenAI-compatible ``/v1/completions`` endpoint (docs/served-peer.md): the very
settings class of ``graftrl train``'s served ``peers[]`` entries, so every default is written once.
Built with keywords: ``ServedPeer(endpoint=..., model=..., name=...)``; ``template`` holds
``{problem}`` (``{prompt}``, its former placeholder, is read as ``{problem}`` for one release,
with a DeprecationWarning)."""


def prompt_of(prompt: Any) -> str:
    """A dataset prompt as the text a served peer's template receives (module docstring)."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise ValueError("a conversational prompt without a user message cannot be sent to a served peer")
    content = users[-1].get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


class ServedPeerSession:
    """One ``ServedPeer`` opened by a trainer: its client, the probe, each batch's groups."""

    def __init__(self, peer: ServedPeer, sampling: SamplingRequest) -> None:
        self.peer = peer
        self.sampling = sampling
        self.client = client_of(peer)
        self.totals = RequestStats()

    def probe(self, prompt: Any) -> None:
        """ServedPeerError (one line) unless the endpoint answers as the training will need."""
        self.client.probe(
            self.peer.template.format(problem=prompt_of(prompt)),
            self.sampling,
            f"ServedPeer {self.peer.name}",
        )

    def groups(
        self, step: int, prompt_ids: Sequence[str], prompts: Sequence[Any], asked: Sequence[int], seed: int
    ) -> tuple[list[list[StoredTrajectory] | None], dict[str, float]]:
        """[P] the peer's group on each prompt of ``asked`` that it answered (rewards 0 until the
        trainer verifies them), None elsewhere; and the batch's cost metrics."""
        n = self.sampling.n
        texts = [self.peer.template.format(problem=prompt_of(prompts[p])) for p in asked]
        answers, stats = self.client.complete(texts, self.sampling, [seed + p for p in asked])
        self.totals.merge(stats)
        got = [(p, a) for p, a in zip(asked, answers, strict=True) if a is not None]
        rows = served_rows(
            step=step,
            source=self.peer.name,
            prompt_ids=prompt_ids,
            prompt_texts=[prompt_of(prompt) for prompt in prompts],
            indices=[p for p, _ in got],
            answers=[a for _, a in got],
            rewards=[[0.0] * n for _ in got],  # placeholders: the trainer verifies and re-advantages them
            n=n,
            tokenizer_id=f"served:{self.peer.model}",
            adv_eps=0.0,
            adv_std_unbiased=True,
        )
        out: list[list[StoredTrajectory] | None] = [None] * len(prompt_ids)
        for (p, _), group in zip(got, rows, strict=True):
            out[p] = group
        return out, {f"served_{key}/{self.peer.name}": float(getattr(stats, key)) for key in COST_KEYS}

    def close(self) -> None:
        self.client.close()
