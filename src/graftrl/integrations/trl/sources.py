"""``GraftGRPOTrainer``'s peers as peer sources: ``graftrl train``'s interface (``training.peer_sources``).

No TRL import. Each entry of ``peers=[...]`` becomes one ``PeerSource``, opened when the trainer
is built (before the first batch), and each generation batch asks every source once, in order
(stored, served, then the other kinds), with the batch's prompts as ``Problem`` rows, the
receiver's outcomes and the batch's verifier (``BatchVerifier``: this trainer's reward functions).
The kinds and what builds them:

- ``stored`` (a store folder, ``StoredPeer`` or a ``StoredPeerConfig``): ``StoredPeerSource``, a
  ``storage.peers.PeerStore`` matched by ``graft_peer_match``, re-verified on the all-fail prompts
  (``graft_reverify``);
- ``served`` (``ServedPeer``): ``served.ServedPeerSource``;
- any other kind registered with ``register_source`` (its settings class with
  ``config.peers.register_peer_settings``): its own source, built as ``graftrl train`` builds it,
  on ``trl_run``'s ``PeerRun`` (the run settings a source reads, taken from the trainer's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

import graftrl.training.peer_sources as peer_sources
from graftrl.config.peers import PeerSettings
from graftrl.core.advantages import ADV_EPS, ADV_STD_UNBIASED
from graftrl.integrations.trl._compat import TRLIntegrationError
from graftrl.models.served import SamplingRequest
from graftrl.models.served_groups import dense_records
from graftrl.storage.peers import PeerStore, StoredPeer, dataset_prompt_ids, prompt_id_of
from graftrl.storage.problems import Problem
from graftrl.training.peer_sources import PeerRun, PeerSource, Receivers, SourceBase, SourceGroups
from graftrl.training.trajectories import PeerGroups, peer_groups

PROMPT = "prompt"
"""``Problem.extra`` key of a batch problem's dataset prompt as TRL holds it (a string or a chat)."""


def prompt_of(prompt: Any) -> str:
    """A dataset prompt as text: the string itself, or a conversation's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise ValueError("a conversational prompt without a user message cannot be sent to a served peer")
    content = users[-1].get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def graft_seed(seed: int, step: int, stream: int) -> int:
    """The seed of (run seed, generation batch, stream); 63 bits (``GraftGRPOTrainer._graft_generator``)."""
    return int(np.random.SeedSequence([seed, step, stream]).generate_state(1, dtype=np.uint64)[0]) >> 1


def all_failed(receivers: Receivers) -> list[int]:
    """The prompts on which a receiver had no success (eq. 4's k = 0)."""
    return torch.stack([o.successes == 0 for o in receivers.values()]).any(dim=0).nonzero().flatten().tolist()


@dataclass(frozen=True)
class TRLRun(PeerRun):
    """A ``GraftGRPOTrainer``'s ``PeerRun``: ``config`` holds what a source may read of a run
    (``rollout.n``, ``max_new_tokens``, ``temperature``, ``top_p``; ``reward.success_threshold``;
    ``train.adv_eps``, ``adv_std_unbiased``; ``seed``; ``data.prompt_suffix``: None), ``problems``
    the dataset's rows, no sampler; plus TRL's own settings."""

    prompt_ids: list[str] | None = None
    """Every dataset row's prompt id (None: an iterable dataset)."""
    match: str = "step"
    reverify: bool = True
    sampling: Any = None
    """The served requests' ``SamplingRequest``."""


class DatasetProblems(Sequence[Problem]):
    """A TRL dataset's rows as ``Problem`` rows, made when read (``TRLRun.problems``)."""

    def __init__(self, dataset: Any, column: str) -> None:
        self.dataset, self.column = dataset, column

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        row = self.dataset[index]
        return problem_of(row, prompt_id_of(row, self.column))


def trl_run(trainer: Any) -> TRLRun:
    """The trainer's ``TRLRun`` (its class docstring)."""
    args, n = trainer.args, trainer.num_generations
    sampling = SamplingRequest(n, args.max_completion_length, args.temperature, args.top_p)
    config = SimpleNamespace(
        seed=args.seed,
        rollout=SimpleNamespace(
            n=n, max_new_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p
        ),
        reward=SimpleNamespace(success_threshold=trainer.graft_threshold),
        train=SimpleNamespace(adv_eps=ADV_EPS, adv_std_unbiased=ADV_STD_UNBIASED),
        data=SimpleNamespace(prompt_suffix=None),
    )
    problems = DatasetProblems(trainer.train_dataset, trainer.prompt_id_column)
    prompt_ids = dataset_prompt_ids(trainer.train_dataset, trainer.prompt_id_column)
    return TRLRun(config, problems, None, prompt_ids, trainer.graft_match, trainer.graft_reverify, sampling)


class StoredPeerSource(SourceBase):
    """A stored peer replayed in TRL: the groups of the batch's prompts, re-verified where the
    receiver failed all n (``graft_reverify``)."""

    def __init__(self, settings: Any, run: Any) -> None:
        if isinstance(settings, PeerSettings):  # a StoredPeerConfig: its store and name (TRL matches
            # by graft_peer_match, not its `match`)
            settings = StoredPeer(settings.path, settings.name)
        self.store = PeerStore(settings)
        settings = SimpleNamespace(name=self.store.source)
        super().__init__(settings, run)

    def open(self) -> None:
        self.store.check_covers(self.run.prompt_ids, self.run.config.rollout.n)

    def groups(
        self, step: int, problems: Sequence[Problem], receivers: Receivers, verifier: Any
    ) -> SourceGroups:
        n = self.run.config.rollout.n
        groups = self.store.groups([p.id for p in problems], step, self.run.match)
        checked = verifier.groups(groups, all_failed(receivers)) if self.run.reverify else None
        replayed = peer_groups(groups, n, checked, success_threshold=self.run.config.reward.success_threshold)
        records = dense_records(replayed.records, problems, step, self.name, n)
        info = {f"stored_reward_changes/{self.name}": float(replayed.reward_changes)}
        answered = [p for p, group in enumerate(groups) if group is not None]
        return SourceGroups(replayed.outcomes, records, info=info, shared=True, answered=answered)


def kind_of(peer: Any) -> str:
    """A ``peers=`` entry's kind: ``stored`` for a folder or ``StoredPeer``, else its ``source``."""
    return "stored" if isinstance(peer, StoredPeer | str | Path) else str(peer.source)


def build_sources(
    peers: Sequence[Any], run: TRLRun, built_in: dict[str, Any], receiver: str
) -> list[PeerSource]:
    """Each entry's source (``built_in``: TRL's own kinds, before the registry's), in answering
    order, each opened; TRLIntegrationError (one line) for an unknown kind or a name given twice."""
    registry = peer_sources.SOURCES  # read when called: a kind registered since counts
    kinds = [*built_in, *(kind for kind in registry if kind not in built_in)]
    for peer in peers:
        if kind_of(peer) not in kinds:
            raise TRLIntegrationError(f"peers: {peer!r} is of no peer kind (known: {', '.join(kinds)})")
    ordered = sorted(peers, key=lambda peer: kinds.index(kind_of(peer)))
    sources = [(built_in.get(kind_of(p)) or registry[kind_of(p)])(p, run) for p in ordered]
    names = [source.name for source in sources]
    for name in names:
        if name == receiver or names.count(name) > 1:
            why = "is the receiver's name in GRAFT's plan" if name == receiver else "appears twice"
            raise TRLIntegrationError(
                f"peers: {name!r} {why}; give each peer a name of its own (a stored peer's "
                "record_source, ServedPeer(name=...)), and replay each stored source once"
            )
    for source in sources:
        source.open()
    return sources


def peer_groups_of(got: SourceGroups, n: int) -> PeerGroups:
    """A source's groups as ``graft_exchange`` takes them: per prompt, None where it has none."""
    found = range(got.outcomes.rewards.shape[0]) if got.answered is None else got.answered
    records: list[Any] = [None] * got.outcomes.rewards.shape[0]
    for p in found:
        records[p] = got.records[p * n : (p + 1) * n]
    changes = sum(int(v) for k, v in got.info.items() if k.startswith("stored_reward_changes/"))
    return PeerGroups(got.outcomes, records, len(found), changes)


def problem_of(row: Mapping[str, Any], prompt_id: str) -> Problem:
    """A dataset row as the ``Problem`` a source gets: its prompt id, its prompt's text (a chat's
    last user message; empty without one), its ``answer`` column, the row itself in ``extra``."""
    try:
        text = prompt_of(row[PROMPT])
    except ValueError:
        text = ""
    return Problem(prompt_id, text, str(row.get("answer", "")), extra=dict(row))
