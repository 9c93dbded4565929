"""A new kind of peer is one module and one settings class (docs/architecture.md): a toy source
registered here, and nothing else, trains with a co-trained pair."""

from __future__ import annotations

from typing import ClassVar, Literal

from conftest import TextRewards, make_config, make_row

from graftrl.config import config_from_dict
from graftrl.config import peers as peer_config
from graftrl.config.peers import PeerSettings, register_peer_settings
from graftrl.storage.rundir import read_metrics
from graftrl.training import peer_sources
from graftrl.training.peer_sources import PeerSource, SourceBase, SourceGroups, register_source
from graftrl.training.trainer import Trainer
from graftrl.training.trajectories import peer_groups


class ToyPeerConfig(PeerSettings):
    source: Literal["toy"] = "toy"
    """`toy`: a test's peer."""
    words: str = "toy"
    """The word its responses repeat."""


class ToySource(SourceBase):
    """Answers every prompt with n fixed texts, verified by the run's verifier."""

    opened: ClassVar[list[str]] = []

    def open(self) -> None:
        ToySource.opened.append(self.name)

    def groups(self, step, problems, receivers, verifier) -> SourceGroups:
        n = self.run.config.rollout.n
        groups = [
            [
                make_row(
                    step,
                    self.name,
                    str(problem.id),
                    p,
                    i,
                    0.0,
                    n=n,
                    response=f"{self.settings.words} {p} {i}",
                )
                for i in range(n)
            ]
            for p, problem in enumerate(problems)
        ]
        texts = [row.response for group in groups for row in group]
        rewards = verifier.rewards(texts, [problem for problem in problems for _ in range(n)])
        replayed = peer_groups(groups, n, {p: rewards[p * n : (p + 1) * n] for p in range(len(problems))})
        records = [record for group in replayed.records for record in group or ()]
        return SourceGroups(replayed.outcomes, records, shared=True)


def test_a_registered_toy_source_trains(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(peer_config, "PEER_SETTINGS", dict(peer_config.PEER_SETTINGS))
    monkeypatch.setattr(peer_sources, "SOURCES", dict(peer_sources.SOURCES))
    register_peer_settings("toy", ToyPeerConfig)
    register_source("toy")(ToySource)
    monkeypatch.setattr(ToySource, "opened", [])
    raw = make_config(tiny_checkpoints, steps=1)
    raw["peers"] = [{"name": "toy", "source": "toy", "words": "forty two"}]
    config = config_from_dict(raw)
    assert isinstance(config.peers[0], ToyPeerConfig) and config.peers[0].words == "forty two"
    trainer = Trainer(config, tmp_path / "run", verifier=TextRewards())
    assert ToySource.opened == ["toy"] and isinstance(trainer.sources[0], PeerSource)
    trainer.train()
    rows = read_metrics(tmp_path / "run")
    assert {row["model"] for row in rows} == {"llama", "gpt2"} and len(rows) == 2
    assert all("candidates/toy" in row and "complementarity/toy" in row for row in rows)
