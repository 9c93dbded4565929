"""Recording trajectories, training against a stored peer (algorithm.md §2.3), K > 2 GRAFT, byte scores."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CROSSED, ScriptedRewards, make_config, make_row

from graftrl.config import config_from_dict
from graftrl.core import multi_source_selection, transfer_candidates
from graftrl.models.policy import Policy
from graftrl.models.rollout import content_mean_logprob
from graftrl.storage.peers import DEFAULT_PEER_MATCH, PeerStore, StoredPeer
from graftrl.storage.rundir import read_metrics
from graftrl.storage.store import StoreError, TrajectoryStore, TrajectoryWriter
from graftrl.training import worker as worker_module
from graftrl.training.rows import build_rows
from graftrl.training.trainer import Trainer

LLAMA, GPT2 = CROSSED  # [P, n] reward patterns: llama fails prompt 0, gpt2 fails prompt 1


def single(config: dict, name: str, **extra) -> dict:
    """The config with one policy kept."""
    return {**config, "policies": [p for p in config["policies"] if p["name"] == name], **extra}


def record_gpt2(tiny_checkpoints, tmp_path, steps=2):
    config = single(make_config(tiny_checkpoints, method="grpo", steps=steps), "gpt2", store={"record": True})
    Trainer(config_from_dict(config), tmp_path / "gpt2-grpo", verifier=ScriptedRewards([GPT2])).train()
    return tmp_path / "gpt2-grpo" / "store"


def test_recorded_store_holds_every_group(tiny_checkpoints, tmp_path):
    store = TrajectoryStore(record_gpt2(tiny_checkpoints, tmp_path))
    assert store.steps() == [0, 1]
    rows = store.read_step(0)
    assert len(rows) == 4 * 4 and {r.source for r in rows} == {"gpt2"}
    assert [r.reward for r in sorted(rows, key=lambda r: (r.group_index, r.index))] == [
        x for g in GPT2 for x in g
    ]
    assert store.verify().ok


def test_training_against_a_stored_peer_transfers_what_the_rule_selects(tiny_checkpoints, tmp_path):
    store_path = record_gpt2(tiny_checkpoints, tmp_path)
    config = single(
        make_config(tiny_checkpoints, steps=2), "llama", peers=[{"name": "gpt2", "path": str(store_path)}]
    )
    trainer = Trainer(
        config_from_dict(config), tmp_path / "llama-stored", verifier=ScriptedRewards([LLAMA, GPT2])
    )
    assert [p.name for p in trainer.policies] == ["llama"]  # the partner model is never loaded
    trainer.train()
    expected = transfer_candidates(torch.tensor(LLAMA).sum(-1), torch.tensor(GPT2).sum(-1), 4)  # one-way: all
    rows = read_metrics(tmp_path / "llama-stored")
    assert [r["model"] for r in rows] == ["llama", "llama"]
    for row in rows:
        assert row["candidates/gpt2"] == row["selected/gpt2"] == float(expected.sum())
        assert row["peer_responses"] == 4 * int(expected.sum())
        assert row["stored_reward_changes/gpt2"] == 0.0
    # the grafted responses are the stored texts of the selected prompts
    compat = [
        json.loads(line)
        for line in (tmp_path / "llama-stored" / "compatibility.jsonl").read_text().splitlines()
    ]
    stored = TrajectoryStore(store_path).read_step(0)
    selected = expected.nonzero().flatten().tolist()
    assert compat[0]["reward"] == [
        r.reward for r in sorted(stored, key=lambda r: (r.group_index, r.index)) if r.group_index in selected
    ]


def test_stored_peer_errors_name_the_fix(tiny_checkpoints, tmp_path):
    store_path = record_gpt2(tiny_checkpoints, tmp_path, steps=1)
    config = single(
        make_config(tiny_checkpoints, steps=2), "llama", peers=[{"name": "gpt2", "path": str(store_path)}]
    )
    # Refused when the trainer is built (before any model loads), not when training reaches step 1.
    with pytest.raises(
        StoreError, match=r"steps 0\.\.0 \(1 steps\), the run needs steps 0\.\.1.*match: prompt_id"
    ):
        Trainer(config_from_dict(config), tmp_path / "run", verifier=ScriptedRewards([LLAMA, GPT2]))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    by_id = single(
        make_config(tiny_checkpoints, steps=2),
        "llama",
        peers=[{"name": "gpt2", "path": str(store_path), "match": "prompt_id"}],
    )
    # by prompt id the step-0 groups serve any step whose prompts they cover; step 1 has new ones
    with pytest.raises(StoreError, match=r"no group of source 'gpt2' at any step for .* step 1's"):
        Trainer(config_from_dict(by_id), tmp_path / "run2", verifier=ScriptedRewards([LLAMA, GPT2]))
    other = single(
        make_config(tiny_checkpoints, steps=1), "llama", peers=[{"name": "qwen", "path": str(store_path)}]
    )
    with pytest.raises(StoreError, match=r"holds no trajectories of source 'qwen' .*its sources: gpt2"):
        Trainer(config_from_dict(other), tmp_path / "run3", verifier=ScriptedRewards([LLAMA, GPT2]))
    wider = single(
        make_config(tiny_checkpoints, steps=1), "llama", peers=[{"name": "gpt2", "path": str(store_path)}]
    )
    wider["rollout"]["n"] = 2
    with pytest.raises(StoreError, match=r"hold \[4\] responses, the run's rollout.n is 2"):
        Trainer(config_from_dict(wider), tmp_path / "run4", verifier=ScriptedRewards([LLAMA, GPT2]))


def test_one_lookup_where_nearest_differs_from_step(tmp_path):
    """The rules of ``storage.peers``, which graftrl train's coverage check and step and the TRL
    integration all call: a peer recorded at steps 0 and 2 serves step 1 by ``nearest`` (step 0's
    group, the earlier on a tie) and by ``prompt_id`` (the latest, step 2's), never by ``step``,
    the one default."""
    writer = TrajectoryWriter(tmp_path / "store")
    for step in (0, 2):
        writer.write_step(step, [make_row(step, "peer", "a", 0, i, float(i == 0), n=2) for i in range(2)])
    peers = PeerStore(StoredPeer(tmp_path / "store", source="peer"))
    assert DEFAULT_PEER_MATCH == "step" == config_from_dict(
        {"policies": [{"name": "x", "path": "/x"}], "data": {"train": "t.jsonl"}, "method": "graft",
         "peers": [{"name": "peer", "path": str(tmp_path / "store")}]}
    ).peers[0].match  # fmt: skip
    with pytest.raises(StoreError, match=r"peers\[peer\]: .* no group of source 'peer' at step 1 for 1 of"):
        peers.serve(["a"], 1, "step", "peers[peer]: store S", n=2)
    (nearest,) = peers.serve(["a"], 1, "nearest", "peers[peer]: store S", n=2)
    (latest,) = peers.serve(["a"], 1, "prompt_id", "peers[peer]: store S", n=2)
    assert {row.step for row in nearest} == {0} and {row.step for row in latest} == {2}
    with pytest.raises(StoreError, match=r"hold \[2\] responses, the run's rollout.n is 4"):
        peers.serve(["a"], 0, "step", "peers[peer]: store S", n=4)


def test_graft_with_three_policies_follows_the_multi_source_rule(tiny_checkpoints, tmp_path):
    config = make_config(tiny_checkpoints, steps=1)
    config["policies"].append(
        {"name": "llama2", "path": str(tiny_checkpoints["llama"]), "template": "{problem}="}
    )
    third = [[1, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
    trainer = Trainer(
        config_from_dict(config), tmp_path / "k3", verifier=ScriptedRewards([LLAMA, GPT2, third])
    )
    trainer.train()
    successes = torch.tensor([LLAMA, GPT2, third]).sum(-1)
    chosen = multi_source_selection(successes, 4)
    names = ["llama", "gpt2", "llama2"]
    rows = {row["model"]: row for row in read_metrics(tmp_path / "k3")}
    for r, receiver in enumerate(names):
        for j, source in enumerate(names):
            if j != r:
                assert rows[receiver][f"selected/{source}"] == float((chosen[r] == j).sum())


def test_byte_normalised_compatibility(tiny_checkpoints, tmp_path, monkeypatch):
    config = make_config(tiny_checkpoints, steps=1)
    config["graft"] = {"compat_normalization": "byte"}
    fresh = Policy.from_pretrained("gpt2", str(tiny_checkpoints["gpt2"]), template="Q: {problem}\nA: ")
    trainer = Trainer(config_from_dict(config), tmp_path / "byte", verifier=ScriptedRewards(CROSSED))
    captured = {}

    def spy(step, rollout, plan, records, *, policy, **rest):
        captured[policy.name] = records
        return build_rows(step, rollout, plan, records, policy=policy, **rest)

    monkeypatch.setattr(worker_module, "build_rows", spy)
    trainer.train()
    compat = {
        c["receiver"]: c
        for c in map(json.loads, (tmp_path / "byte" / "compatibility.jsonl").read_text().splitlines())
    }
    records = captured["gpt2"]["llama"][4:8]  # gpt2 receives llama's group on prompt 1
    for record, s in zip(records, compat["gpt2"]["s"], strict=True):
        ids = fresh.encode_response(record.response, record.finished)
        problem = trainer.sampler.batch(0)[1].problem
        logprobs = fresh.score(fresh.encode_prompts([problem]), [ids])[0]
        content = content_mean_logprob(logprobs, record.finished) * (len(ids) - int(record.finished))
        expected = torch.exp(
            torch.tensor((content - record.mean_logprob * record.num_tokens) / max(record.num_bytes, 1))
        )
        assert s == pytest.approx(float(expected), rel=1e-3, abs=1e-5)
