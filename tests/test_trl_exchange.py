"""graftrl.integrations.trl without TRL (default tier): prompt ids, the stored-peer matching rule,
GRAFT on a generation batch (successes counted at a threshold), the finite-reward check, the
peer-last order, and the import boundary. TRL itself is
exercised by tests/test_trl_integration.py (tier ``-m trl``)."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest
import torch
from conftest import SRC, make_row

from graftrl.core import compatibility_weight, grpo_advantages
from graftrl.core.advantages import reverified_advantages
from graftrl.integrations.trl import (
    StoredPeer,
    TRLIntegrationError,
    graft_exchange,
    peer_groups,
    peer_last_order,
    prompt_hash,
    prompt_id_of,
)
from graftrl.integrations.trl.exchange import IS_PEER
from graftrl.integrations.trl.recording import check_finite, combined_rewards
from graftrl.methods.graft import GRAFT, GraftConfig
from graftrl.storage.peers import PeerStore, dataset_prompt_ids
from graftrl.storage.store import StoreError, TrajectoryStore, TrajectoryWriter


def write_store(
    root: Path, steps: dict[int, list[str]], source: str = "peer", n: int = 2, rewards=None
) -> Path:
    """steps: step -> prompt ids (group order); rewards: prompt -> [n] (default 1, 0, ...)."""
    writer = TrajectoryWriter(root)
    for step, prompts in steps.items():
        rows = []
        for group, prompt in enumerate(prompts):
            values = (rewards or {}).get(prompt, [float(i % 2 == 0) for i in range(n)])
            rows += [make_row(step, source, prompt, group, i, values[i], n=n) for i in range(n)]
        writer.write_step(step, rows)
    return root


# ----- prompt ids and matching ----------------------------------------------------------------


def test_prompt_ids_come_from_the_column_else_a_hash_of_the_prompt():
    assert prompt_id_of({"prompt": "1+1=", "prompt_id": 7}) == "7"
    assert prompt_id_of({"prompt": "1+1="}) == prompt_hash("1+1=") != prompt_hash("1+2=")
    chat = [{"role": "user", "content": "1+1"}]
    assert prompt_id_of({"prompt": chat}) == prompt_hash([{"content": "1+1", "role": "user"}])
    assert prompt_id_of({"prompt": "x", "id": "a"}, column="id") == "a"
    assert dataset_prompt_ids([{"prompt": "x"}, {"prompt": "y", "prompt_id": "b"}]) == [prompt_hash("x"), "b"]
    with pytest.raises(StoreError, match="neither a 'prompt_id' column nor a 'prompt'"):
        prompt_id_of({"text": "x"})


def test_matching_rule_step_nearest_and_latest(tmp_path):
    root = write_store(tmp_path / "s", {0: ["a", "b"], 2: ["a"], 5: ["a", "c", "a"]})
    store = PeerStore(root)
    assert store.locate("a", 2, "step") == (2, 0)
    assert store.locate("b", 2, "step") is None
    assert store.locate("a", 5, "step") == (5, 2)  # a prompt twice in one step: the later group
    assert store.locate("a", 1, "nearest") == (0, 0)  # tie between steps 0 and 2: the earlier
    assert store.locate("a", 3, "nearest") == (2, 0)
    assert store.locate("a", 4, "nearest") == (5, 2)
    assert store.locate("b", 9, "nearest") == (0, 1)
    assert store.locate("a", 0, "prompt_id") == (5, 2)  # the latest occurrence, whatever the step
    assert store.locate("zz", 0, "nearest") is None
    groups = store.groups(["a", "zz", "c"], 4, "nearest")
    assert groups[1] is None
    assert [(r.step, r.group_index, r.index) for r in groups[0]] == [(5, 2, 0), (5, 2, 1)]
    assert [r.prompt_id for r in groups[2]] == ["c", "c"]
    # the store's own index, which the rule reads
    assert TrajectoryStore(root).occurrences("peer")[("a", "peer")] == [(0, 0), (2, 0), (5, 0), (5, 2)]


def test_store_checks_name_the_fix(tmp_path):
    root = write_store(tmp_path / "s", {0: ["a", "b"]})
    store = PeerStore(StoredPeer(root))
    assert store.check_covers(["a", "x"], n=2) == 1
    with pytest.raises(StoreError, match="none of the dataset's 2 prompt ids") as caught:
        store.check_covers(["x", "y"], n=2)
    assert "\n" not in str(caught.value)
    with pytest.raises(StoreError, match="num_generations is 4; set num_generations=2"):
        store.check_covers(["a"], n=4)
    both = write_store(tmp_path / "two", {0: ["a"]}, source="one")
    TrajectoryWriter(both).write_step(1, [make_row(1, "two", "a", 0, i, float(i == 0)) for i in range(2)])
    with pytest.raises(StoreError, match=r"holds sources \['one', 'two'\]; name the one"):
        PeerStore(both)
    with pytest.raises(StoreError, match="no source 'three'"):
        PeerStore(StoredPeer(both, "three"))
    assert PeerStore(StoredPeer(both, "two")).places == {"a": [(1, 0)]}


def test_reverified_groups_keep_stored_advantages_unless_their_rewards_changed(tmp_path):
    stored = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    stored_adv = torch.tensor([[0.5, -0.5], [0.0, 0.0]])
    new = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    advantages, changed = reverified_advantages(stored, stored_adv, new)
    assert changed.tolist() == [False, True]
    assert advantages[0].tolist() == [0.5, -0.5]  # kept from the store (the source computed them)
    assert advantages[1].tolist() == grpo_advantages(new[1:])[0].tolist()
    root = write_store(tmp_path / "s", {0: ["a", "b"]})
    groups = PeerStore(root).groups(["a", "b", "none"], 0, "step")
    result = peer_groups(groups, n=2, reverified={1: [0.0, 0.0]})
    assert result.found == 2 and result.reward_changes == 1
    assert result.outcomes.rewards.tolist() == [[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    assert result.records[2] is None
    assert [r.advantage for r in result.records[1]] == [0.0, 0.0]
    assert [r.advantage for r in result.records[0]] == pytest.approx(
        [0.7071, -0.7071]
    )  # float32, as graftrl train


# ----- GRAFT on a batch -------------------------------------------------------------------------


def fake_batch(num_prompts: int, n: int, width: int, old: bool):
    rows = num_prompts * n
    batch = {
        "prompt_ids": torch.arange(rows * 3).view(rows, 3),
        "prompt_mask": torch.ones(rows, 3, dtype=torch.long),
        "completion_ids": torch.full((rows, width), 5),
        "completion_mask": torch.ones(rows, width, dtype=torch.long),
        "advantages": torch.linspace(-1, 1, rows),
        "num_items_in_batch": torch.tensor(rows * width),
    }
    if old:
        batch["old_per_token_logps"] = torch.full((rows, width), -0.5)
    return batch


def test_exchange_replaces_all_fail_groups_folds_w_and_drops_w0_rows():
    n = 2
    rewards = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])  # prompts 0 and 2 failed all n
    peer_rewards = [[1.0, 0.0], [1.0, 0.0], [0.0, 0.0]]  # only prompt 0's peer group is mixed
    records = [
        [make_row(0, "peer", f"q{p}", p, i, peer_rewards[p][i], n=n) for i in range(n)] for p in range(3)
    ]
    peers = {"peer": peer_groups(records, n)}
    s_targets = [0.9, 0.5]  # response 0 admitted with w = 0.9, response 1 gated out (w = 0)

    def encode(text, finished):
        return [7] * (len(text) % 4 + 1) + ([2] if finished else [])

    def score(prompt_ids, prompt_mask, completions):
        assert prompt_ids.shape[0] == len(completions) == 2
        assert torch.equal(prompt_ids, torch.arange(6 * 3).view(6, 3)[:2])  # the receiver's own prompt rows
        out = []
        for k, completion in enumerate(completions):
            record = records[0][k]
            content = len(completion) - int(record.finished)
            lbar = record.mean_logprob + float(torch.tensor(s_targets[k]).log())
            values = torch.full((len(completion),), lbar)
            if record.finished:
                values[-1] = -9.0  # the EOS is outside lbar
            assert content >= 1
            out.append(values)
        return out

    batch = fake_batch(3, n, width=2, old=True)
    method = GRAFT(GraftConfig(balance=False))
    exchange = graft_exchange(
        batch,
        rewards,
        peers,
        method,
        receiver="r",
        encode=encode,
        score=score,
        pad_token_id=0,
        plan_generator=torch.Generator().manual_seed(0),
        weight_generator=torch.Generator().manual_seed(1),
    )
    out = exchange.batch
    assert exchange.selected == [0]
    assert exchange.s.tolist() == pytest.approx(s_targets, rel=1e-5)
    assert exchange.w.tolist() == pytest.approx(compatibility_weight(torch.tensor(s_targets)).tolist())
    assert out[IS_PEER].tolist() == [True, True, False, False, False, False]
    ids0 = encode(records[0][0].response, records[0][0].finished)
    width = max(2, len(ids0), len(encode(records[0][1].response, records[0][1].finished)))
    assert out["completion_ids"].shape == (6, width)
    assert out["completion_ids"][0, : len(ids0)].tolist() == ids0
    assert out["completion_mask"][0].tolist() == [1] * len(ids0) + [0] * (width - len(ids0))
    assert out["completion_mask"][1].sum() == 0  # w = 0: out of the loss and of the denominator
    w0 = float(exchange.w[0])
    assert w0 == pytest.approx(0.9, rel=1e-5)
    assert float(out["advantages"][0]) == pytest.approx(records[0][0].advantage * w0)  # the source's x w
    assert float(out["advantages"][1]) == 0.0
    assert out["advantages"][2:].tolist() == batch["advantages"][2:].tolist()  # own rows unchanged
    assert int(out["num_items_in_batch"]) == len(ids0) + 4 * 2
    assert out["old_per_token_logps"][0, : len(ids0)].tolist() == pytest.approx(
        score(
            batch["prompt_ids"][:2], batch["prompt_mask"][:2], [ids0, encode(records[0][1].response, True)]
        )[0].tolist()
    )
    assert out["old_per_token_logps"][2:, :2].tolist() == batch["old_per_token_logps"][2:].tolist()
    metrics = exchange.metrics
    assert (
        metrics["candidates/peer"] == 1 and metrics["selected/peer"] == 1 and metrics["transferred/peer"] == 2
    )
    assert (
        metrics["peer_admitted"] == 1
        and metrics["admit_rate"] == 0.5
        and metrics["peer_prompts_found/peer"] == 3
    )
    # without old log-probs in the batch (TRL's aligned case) none are invented
    aligned = graft_exchange(
        fake_batch(3, n, 2, old=False),
        rewards,
        peers,
        method,
        receiver="r",
        encode=encode,
        score=score,
        pad_token_id=0,
        plan_generator=torch.Generator(),
        weight_generator=torch.Generator(),
    )
    assert "old_per_token_logps" not in aligned.batch
    # success_only: the failed peer response never enters (no score, empty row)
    only = GRAFT(GraftConfig(balance=False, transfer="success_only"))
    kept = graft_exchange(
        fake_batch(3, n, 2, old=False),
        rewards,
        peers,
        only,
        receiver="r",
        encode=encode,
        score=lambda prompt_ids, prompt_mask, completions: [torch.full((len(c),), -0.1) for c in completions],
        pad_token_id=0,
        plan_generator=torch.Generator(),
        weight_generator=torch.Generator(),
    )
    assert kept.metrics["transferred/peer"] == 1 and kept.batch["completion_mask"][1].sum() == 0
    with pytest.raises(ValueError, match="not supported"):
        graft_exchange(
            {**batch, "ref_per_token_logps": batch["advantages"]},
            rewards,
            peers,
            method,
            receiver="r",
            encode=encode,
            score=score,
            pad_token_id=0,
            plan_generator=torch.Generator(),
            weight_generator=torch.Generator(),
        )


def test_exchange_counts_successes_at_the_threshold():
    """Fractional rewards: the receiver's all-fail and the peer's mixed groups are counted in
    successes (reward >= threshold), never in summed rewards; on 0/1 rewards every threshold in
    (0, 1] selects what the rewards' sum did."""
    n = 2
    # prompt 0: the receiver's partial passes, a peer with a full pass; prompt 1: the receiver
    # scores 0, a peer with partial passes only
    rewards = torch.tensor([[0.5, 0.75], [0.0, 0.0]])
    peer_rewards = [[1.0, 0.25], [0.5, 0.0]]

    def selected(receiver_rewards, peer_values, threshold):
        records = [
            [make_row(0, "peer", f"q{p}", p, i, peer_values[p][i], n=n) for i in range(n)] for p in range(2)
        ]
        exchange = graft_exchange(
            fake_batch(2, n, width=2, old=False),
            receiver_rewards,
            {"peer": peer_groups(records, n, success_threshold=threshold)},
            GRAFT(GraftConfig(balance=False, gate=False)),
            receiver="r",
            encode=lambda text, finished: [7, 2],
            score=lambda prompt_ids, prompt_mask, completions: [
                torch.full((len(c),), -0.1) for c in completions
            ],
            pad_token_id=0,
            plan_generator=torch.Generator(),
            weight_generator=torch.Generator(),
            success_threshold=threshold,
        )
        if exchange.selected:  # the fractions travel as they are
            assert exchange.rewards == [peer_values[p][i] for p in exchange.selected for i in range(n)]
        return exchange.selected

    assert selected(rewards, peer_rewards, 1.0) == [0]  # k = 0 with rewards summing to 1.25
    assert selected(rewards, peer_rewards, 0.5) == [1]
    assert selected(rewards, peer_rewards, 0.0) == []  # every reward a success: no group all-fail
    binary, peer_binary = torch.tensor([[0.0, 0.0], [1.0, 0.0]]), [[1.0, 0.0], [1.0, 0.0]]
    for threshold in (1.0, 0.5, 1e-3):
        assert selected(binary, peer_binary, threshold) == [0]


def test_rewards_must_be_finite_numbers_any_finite_number_passes():
    check_finite(torch.tensor([0.0, 1.0, 0.25, 0.6667, -0.5, 2.0]), "record_store")
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(TRLIntegrationError) as caught:
            check_finite(torch.tensor([1.0, 0.5, bad]), "GraftGRPOTrainer")
        message = str(caught.value)
        assert "\n" not in message and message.startswith("GraftGRPOTrainer: reward ")
        assert "not a finite number" in message and "return a finite float" in message
    # TRL's weighted sum: a None (NaN) reward counts 0, an infinite one is caught
    per_func = torch.tensor([[0.5, float("nan")], [float("inf"), 1.0]])
    combined = combined_rewards(per_func, torch.tensor([1.0, 0.5]))
    assert combined[0] == 0.5 and not bool(torch.isfinite(combined[1]))
    with pytest.raises(TRLIntegrationError, match="reward inf is not a finite number"):
        check_finite(combined, "record_store")


def test_peer_rows_go_last_and_without_them_the_order_is_trls_permutation():
    is_peer = torch.tensor([False, True, False, True, False, False, True, False])
    torch.manual_seed(3)
    order = peer_last_order(is_peer, rows_per_step=2, position="last")
    assert sorted(order.tolist()) == list(range(8))
    assert is_peer[order].tolist() == [False] * 5 + [True] * 3
    first = peer_last_order(is_peer, 2, "first")
    assert is_peer[first].tolist() == [True] * 3 + [False] * 5
    torch.manual_seed(3)
    trl_permutation = torch.randperm(8)
    torch.manual_seed(3)
    assert torch.equal(peer_last_order(torch.zeros(8, dtype=torch.bool), 2, "last"), trl_permutation)


# ----- the import boundary ----------------------------------------------------------------------


def test_integration_imports_without_trl_and_fails_only_when_used(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # as if TRL were not installed
    monkeypatch.delitem(sys.modules, "graftrl.integrations.trl.trainer", raising=False)
    module = importlib.import_module("graftrl.integrations.trl")
    monkeypatch.delattr(module, "trainer", raising=False)  # imported earlier in this process
    assert module.StoredPeer is StoredPeer  # the store side needs no TRL
    with pytest.raises(
        ImportError, match=r"needs TRL .*bash scripts/setup_trl.sh .*pip install -e '\.\[trl\]'"
    ) as caught:
        from graftrl.integrations.trl import GraftGRPOTrainer  # noqa: F401
    assert "\n" not in str(caught.value)


def test_only_the_integration_imports_trl():
    offenders = []
    for path in sorted((SRC / "graftrl").rglob("*.py")):
        if "integrations" in path.relative_to(SRC).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(name == "trl" or name.startswith("trl.") for name in names):
                offenders.append(str(path.relative_to(SRC)))
    assert offenders == []
