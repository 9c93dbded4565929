"""GraftGRPOTrainer with a served peer (TRL tier, ``.venv-trl``: ``python -m pytest -m trl``).

The endpoint answers with the bodies recorded from vLLM (tests/served_replay.py). One generation
batch: only the receiver's all-fail prompts are sent, the served groups are recorded beside the
receiver's own rows, and replaying that record as a stored peer gives the same exchange and loss.
"""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES
from served_replay import ReplayServer, dead_url
from test_trl_integration import text_reward, trl_config

from graftrl.integrations.trl import ServedPeer, StoredPeer
from graftrl.models.served import ServedPeerError
from graftrl.storage.store import TrajectoryStore

pytestmark = pytest.mark.trl

N = 4


def dataset():
    from datasets import Dataset

    rows = [json.loads(line) for line in (FIXTURES / "math_small.jsonl").read_text().splitlines()][:4]
    return Dataset.from_list(
        [{"prompt": r["problem"], "prompt_id": r["id"], "answer": str(r["answer"])} for r in rows]
    )


def run(checkpoint, tmp_path, **peers):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graftrl.integrations.trl import GraftGRPOTrainer

    losses: list[float] = []
    args = trl_config(
        tmp_path, per_device_train_batch_size=4 * N, max_completion_length=8, graft_peer_match="step"
    )
    trainer = GraftGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(checkpoint),
        reward_funcs=text_reward,
        args=args,
        train_dataset=dataset(),
        processing_class=AutoTokenizer.from_pretrained(checkpoint),
        **peers,
    )
    original = trainer.compute_loss

    def compute_loss(model, inputs, *a, **kw):
        loss = original(model, inputs, *a, **kw)
        losses.append(float(loss.detach()))
        return loss

    trainer.compute_loss = compute_loss
    trainer.train()
    return trainer, losses


def test_a_served_peer_in_trl_equals_its_record_replayed_as_a_stored_peer(tiny_checkpoints, tmp_path):
    peer = {"model": "gpt2", "name": "gpt2", "template": "Q: {problem}\nA: ", "backoff_s": 0.01}
    store = tmp_path / "store"
    with ReplayServer(fail=[200, 503]) as server:  # after the probe, a 503 (retried)
        served, served_losses = run(
            tiny_checkpoints["llama"],
            tmp_path / "served",
            peers=[ServedPeer(endpoint=server.url, **peer)],
            record_store=store,
            record_source="llama",
        )
        asked = server.prompts()[1:]  # after the probe
    reader = TrajectoryStore(store)
    rows = reader.read_step(0)
    fails = {
        r.prompt_id for r in rows if r.source == "llama" and not any(
            o.reward for o in rows if o.source == "llama" and o.prompt_id == r.prompt_id
        )
    }  # fmt: skip
    assert {r.prompt_id for r in rows if r.source == "gpt2"} == fails and len(set(asked)) == len(fails) > 0
    assert len(asked) == len(fails) + 1  # one retry
    logged = served.state.log_history[0]
    assert logged["graft/served_prompts/gpt2"] == len(fails) and logged["graft/served_missing/gpt2"] == 0
    assert logged["graft/served_retries/gpt2"] >= 1 and "graft/stored_reward_changes/gpt2" not in logged
    exchange = served.graft_last_exchange

    stored, stored_losses = run(
        tiny_checkpoints["llama"], tmp_path / "stored", peers=[StoredPeer(store, "gpt2")]
    )
    replay = stored.graft_last_exchange
    assert exchange.selected == replay.selected and exchange.sources == replay.sources
    assert exchange.w.tolist() == pytest.approx(replay.w.tolist())
    if exchange.s is not None:
        assert exchange.s.tolist() == pytest.approx(replay.s.tolist())
    assert served_losses == pytest.approx(stored_losses, rel=1e-6)


def test_a_dead_endpoint_is_refused_when_the_trainer_is_built(tiny_checkpoints, tmp_path):
    with pytest.raises(ServedPeerError, match=r"ServedPeer gpt2: endpoint .* gives no answer"):
        run(
            tiny_checkpoints["llama"],
            tmp_path,
            peers=[ServedPeer(endpoint=dead_url(), model="gpt2", name="gpt2", retries=0)],
        )
