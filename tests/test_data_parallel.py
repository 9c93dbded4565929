"""FSDP2 data parallelism inside a policy (``policies[].parallel.data``) on CPU with gloo.

The `distributed` tier (`pytest -m distributed`) runs 2-rank policies against 1-rank runs; the
row-splitting unit tests run in the default tier.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, TextRewards, comparable_metrics, make_config
from safetensors.torch import load_file

from graftrl.config import ConfigError, config_from_dict
from graftrl.training.parallel import rank_device, split_rows
from graftrl.training.ranks import RankFailure, rank_bundles
from graftrl.training.trainer import Trainer

# Float tolerance of a 2-rank run against a 1-rank run. The samples, rewards, plans and row sets
# are identical; only reduction order differs (a rank sums half the rows' gradients, the
# reduce-scatter adds the halves; the grad norm is a sum of per-shard squares): ~1e-7 relative per
# step in float32, amplified by AdamW (lr 1e-2 in these tests) dividing by sqrt(v) over 3 steps.
WEIGHT_ATOL = 1e-4
METRIC_REL = 1e-4


class FailingRewards(TextRewards):
    """Raises on its second call: the scoring rank fails while the other waits in a collective."""

    def __init__(self) -> None:
        self.calls = 0

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        self.calls += 1
        if self.calls == 2:
            raise ValueError("forced verifier failure")
        return super().score(responses, answers)


# ----- default tier: the row split -------------------------------------------------------------
def test_split_rows_balances_tokens_and_keeps_every_row_once():
    lengths = [50, 7, 31, 31, 12, 90, 3, 3, 64, 20]
    shares = split_rows(lengths, 3)
    assert sorted(r for share in shares for r in share) == list(range(len(lengths)))
    assert all(share == sorted(share) for share in shares)
    loads = [sum(lengths[r] for r in share) for share in shares]
    # Longest-first greedy: no rank exceeds the mean by more than the longest row.
    assert max(loads) - min(loads) <= max(lengths)
    assert max(loads) <= sum(lengths) / 3 + max(lengths)
    assert split_rows(lengths, 3) == shares  # deterministic: every rank computes the same split


def test_split_rows_spreads_peer_rows_over_ranks():
    """A peer-last minibatch (own rows, then peer rows) is not sliced contiguously: with equal
    lengths the rows alternate, so both ranks get peer rows."""
    own, peer = 6, 4
    shares = split_rows([10] * (own + peer), 2)
    peer_rows = set(range(own, own + peer))
    assert all(len(set(share) & peer_rows) == peer // 2 for share in shares)
    assert [len(share) for share in shares] == [5, 5]


def test_split_rows_with_more_ranks_than_rows():
    assert split_rows([4, 9], 4) == [[1], [0], [], []]
    assert split_rows([], 2) == [[], []]


def test_parallel_data_config_limits(tiny_checkpoints):
    raw = make_config(tiny_checkpoints)
    raw["policies"][0]["parallel"] = {"data": 2}
    assert config_from_dict(raw).policies[0].parallel.data == 2
    assert config_from_dict({**raw, "validation": {"files": ["x.jsonl"]}}).validation.files  # validates too
    # rollout.engine: vllm runs an engine per rank; its tensor parallelism must divide the ranks
    vllm = {**raw["rollout"], "engine": "vllm"}
    assert config_from_dict({**raw, "rollout": vllm}).rollout.vllm.tensor_parallel_size == 1
    vllm["vllm"] = {"tensor_parallel_size": 2}  # llama has 2 ranks, gpt2 one
    with pytest.raises(ConfigError, match=r"tensor_parallel_size \(2\) must divide policies\[gpt2\]"):
        config_from_dict({**raw, "rollout": vllm})


def test_ray_ranks_share_the_policys_resources_and_see_their_own_gpu(tiny_checkpoints, monkeypatch):
    raw = make_config(tiny_checkpoints)
    raw["policies"][0]["parallel"] = {"data": 4, "placement": "SPREAD"}
    raw["policies"][0]["resources"] = {"num_gpus": 4, "num_cpus": 8}
    spec = config_from_dict(raw).policies[0]
    assert spec.parallel.placement == "SPREAD"
    assert rank_bundles(spec) == [{"CPU": 2.0, "GPU": 1.0}] * 4
    spec = config_from_dict(make_config(tiny_checkpoints)).policies[0]
    assert rank_bundles(spec) == [{"CPU": 1.0}]  # no GPU key on a CPU-only policy
    with pytest.raises(ConfigError, match="placement"):
        config_from_dict(
            {**raw, "policies": [{**raw["policies"][0], "parallel": {"data": 2, "placement": "RING"}}]}
        )
    # spawned ranks share the node's GPUs (cuda:rank); a Ray rank sees only its bundle's (LOCAL_RANK 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert rank_device("cuda", 3) == "cuda:3" and rank_device("cpu", 3) == "cpu"
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert rank_device("cuda", 3) == "cuda:0"


# ----- distributed tier ----------------------------------------------------------------------
def data_parallel_config(paths: dict[str, Path], method: str, ranks: int, steps: int = 3) -> dict:
    raw = make_config(paths, method=method, steps=steps)
    raw["graft"] = {"balance": False}  # every candidate moves: exchanges in both directions
    raw["checkpoint"] = {"every": 1, "keep_last": 5}
    # Two generate chunks of 2 prompts per step, so each rank samples one.
    raw["rollout"] = {**raw["rollout"], "max_batch_size": 8}
    for policy in raw["policies"]:
        policy["parallel"] = {"data": ranks}
    return raw


def exported_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    folder = run / "checkpoints" / f"step_{step:06d}"
    return {
        f"{name}.{key}": value
        for name in ("llama", "gpt2")
        for key, value in load_file(str(folder / name / "model.safetensors")).items()
    }


def assert_runs_match(run: Path, reference: Path, step: int) -> None:
    rows, expected = comparable_metrics(run), comparable_metrics(reference)
    assert len(rows) == len(expected)
    for row, want in zip(rows, expected, strict=True):
        assert row.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, float):
                assert row[key] == pytest.approx(value, rel=METRIC_REL, abs=1e-6), (row["step"], key)
            else:
                assert row[key] == value, (row["step"], key)
    weights, expected_weights = exported_weights(run, step), exported_weights(reference, step)
    assert weights.keys() == expected_weights.keys()
    for key, value in expected_weights.items():
        torch.testing.assert_close(weights[key], value, atol=WEIGHT_ATOL, rtol=0, msg=key)


@pytest.fixture(scope="module")
def one_rank_runs(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    runs = {}
    for method in ("grpo", "graft"):
        run = tmp_path_factory.mktemp(f"one_rank_{method}")
        Trainer(
            config_from_dict(data_parallel_config(tiny_checkpoints, method, 1)), run, verifier=TextRewards()
        ).train()
        runs[method] = run
    return runs


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["grpo", "graft"])
def test_two_ranks_match_one_rank(tiny_checkpoints, tmp_path, one_rank_runs, method):
    run = tmp_path / "two_ranks"
    Trainer(
        config_from_dict(data_parallel_config(tiny_checkpoints, method, 2)), run, verifier=TextRewards()
    ).train()
    if method == "graft":
        assert sum(r["peer_responses"] for r in comparable_metrics(run)) > 0, "the run should exchange"
    assert (run / "checkpoints" / "step_000003" / "llama" / "dcp" / ".metadata").exists()
    assert_runs_match(run, one_rank_runs[method], 3)
    compat, expected = (r / "compatibility.jsonl" for r in (run, one_rank_runs[method]))
    assert compat.exists() == expected.exists()


@pytest.mark.distributed
def test_two_ranks_validate_as_one_rank(tiny_checkpoints, tmp_path):
    """Every rank samples the benchmark on the gathered weights with one device's seeds and rank 0
    verifies: the validation scores, and the best/ selection, are those of the one-rank run."""
    for ranks in (1, 2):
        raw = data_parallel_config(tiny_checkpoints, "grpo", ranks, steps=2)
        raw["checkpoint"] = {"every": 0}
        raw["validation"] = {
            "files": {"small": str(FIXTURES / "math_small.jsonl")},
            "every": 1,
            "samples": 2,
            "max_problems": 4,
        }
        Trainer(config_from_dict(raw), tmp_path / str(ranks), verifier=TextRewards()).train()
    rows = {
        ranks: [
            {k: v for k, v in json.loads(line).items() if not k.startswith("time_")}
            for line in (tmp_path / str(ranks) / "validation.jsonl").read_text().splitlines()
        ]
        for ranks in (1, 2)
    }
    assert len(rows[1]) == 4 and rows[2] == rows[1]  # 2 validations x 2 policies, identical scores
    for name in ("llama", "gpt2"):
        assert (tmp_path / "2" / "best" / name / "model.safetensors").exists()


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["hacpo", "sgt", "luffy"])
def test_two_ranks_match_one_rank_for_every_loss(tiny_checkpoints, tmp_path, method):
    """HACPO's row-count denominator, SGT's NLL token count and LUFFY's shaped peer terms."""
    for ranks in (1, 2):
        raw = data_parallel_config(tiny_checkpoints, method, ranks, steps=2)
        raw["checkpoint"] = {"every": 0}
        # 2 optimizer steps per batch, as this check was calibrated (the recipe's 4 let Adam's
        # update of gpt2's near-zero-gradient position embeddings drift past WEIGHT_ATOL)
        raw["hacpo"] = {"minibatch": "prompts"}
        raw["train"]["kl_coef"] = 0.0  # as calibrated; the KL under ranks: the next test
        Trainer(config_from_dict(raw), tmp_path / str(ranks), verifier=TextRewards()).train()
    assert_runs_match(tmp_path / "2", tmp_path / "1", 2)


@pytest.mark.distributed
def test_two_ranks_match_one_rank_with_a_kl_reference(tiny_checkpoints, tmp_path):
    """The k3 KL to a frozen reference (HACPO's recipe keeps one) under two ranks: its token-mean
    must use the minibatch's kept tokens over both ranks. A per-rank denominator would move the
    weights by a sizeable part of an Adam step (lr 1e-2) at kl_coef 0.1; what two ranks differ by
    with a reference (about 2e-4, the same at kl_coef 1e-3 and 0.1, so not the KL's math) is the
    reduction order that Adam amplifies on near-zero gradients, hence the wider tolerance."""
    for ranks in (1, 2):
        raw = data_parallel_config(tiny_checkpoints, "grpo", ranks, steps=2)
        raw["checkpoint"] = {"every": 0}
        raw["train"]["kl_coef"] = 0.1
        Trainer(config_from_dict(raw), tmp_path / str(ranks), verifier=TextRewards()).train()
    rows, expected = comparable_metrics(tmp_path / "2"), comparable_metrics(tmp_path / "1")
    assert [row["kl"] for row in rows] == pytest.approx([row["kl"] for row in expected], rel=METRIC_REL)
    weights, expected_weights = exported_weights(tmp_path / "2", 2), exported_weights(tmp_path / "1", 2)
    for key, value in expected_weights.items():
        torch.testing.assert_close(weights[key], value, atol=10 * WEIGHT_ATOL, rtol=0, msg=key)


@pytest.mark.distributed
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_resume_on_a_different_rank_count(tiny_checkpoints, tmp_path, one_rank_runs, before, after):
    """Stop after 2 of 3 steps with `before` ranks, resume with `after`: the run ends as the
    one-rank run does (DCP reshards weights and AdamW state; a one-rank checkpoint loads into shards)."""
    run = tmp_path / "run"
    if before == 1:
        shutil.copytree(one_rank_runs["graft"], run)
    else:
        raw = data_parallel_config(tiny_checkpoints, "graft", before, steps=2)
        Trainer(config_from_dict(raw), run, verifier=TextRewards()).train()
    shutil.rmtree(run / "checkpoints" / "step_000003", ignore_errors=True)
    resumed = Trainer(
        config_from_dict(data_parallel_config(tiny_checkpoints, "graft", after)), run, verifier=TextRewards()
    )
    resumed.train(resume=True)
    assert resumed.start_step == 2
    assert_runs_match(run, one_rank_runs["graft"], 3)


@pytest.mark.distributed
def test_ray_backend_hosts_the_ranks(tiny_checkpoints, tmp_path, one_rank_runs, monkeypatch):
    """backend: ray, each policy's 2 ranks as actors of its placement group: the one-rank run's results."""
    import ray

    raw = ray_config(data_parallel_config(tiny_checkpoints, "graft", 2), monkeypatch)
    Trainer(config_from_dict(raw), tmp_path, verifier=TextRewards()).train()
    assert_runs_match(tmp_path, one_rank_runs["graft"], 3)
    assert not ray.is_initialized()


def ray_config(raw: dict, monkeypatch) -> dict:
    # The actors unpickle the test verifiers by reference: they import conftest from tests/.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    return {**raw, "backend": "ray", "ray": {"num_cpus": 2}}


@pytest.mark.distributed
def test_a_failing_ray_rank_stops_the_run_with_its_error(tiny_checkpoints, tmp_path, monkeypatch):
    """backend: ray, a rank actor raises while the other waits in a collective: no hang, named."""
    import ray

    raw = ray_config(one_policy_config(tiny_checkpoints), monkeypatch)
    with pytest.raises(RankFailure, match=r"rank 0 failed during `rollout`.*forced verifier failure"):
        Trainer(config_from_dict(raw), tmp_path, verifier=FailingRewards()).train()
    assert not ray.is_initialized()


@pytest.mark.distributed
def test_ray_ranks_that_cannot_be_placed_fail_with_the_resources(tiny_checkpoints, tmp_path, monkeypatch):
    import ray

    raw = ray_config(one_policy_config(tiny_checkpoints), monkeypatch)
    policy = raw["policies"][0]
    policy["resources"] = {"num_cpus": 8}  # 2 ranks x 4 CPUs on a 2-CPU Ray
    policy["parallel"] = {**policy["parallel"], "timeout_s": 5}
    with pytest.raises(
        RankFailure, match=r"could not place its 2 ranks \(\{'CPU': 4\.0\} each, strategy PACK\)"
    ):
        Trainer(config_from_dict(raw), tmp_path, verifier=TextRewards()).train()
    assert not ray.is_initialized()


def one_policy_config(paths: dict[str, Path]) -> dict:
    raw = data_parallel_config(paths, "grpo", 2)
    raw["policies"] = raw["policies"][:1]
    raw["checkpoint"] = {"every": 0}
    return raw


@pytest.mark.distributed
def test_a_failing_rank_stops_the_run_with_its_error(tiny_checkpoints, tmp_path):
    """Rank 0 raises while rank 1 waits for its rewards in a collective: no hang, the error named."""
    trainer = Trainer(
        config_from_dict(one_policy_config(tiny_checkpoints)), tmp_path, verifier=FailingRewards()
    )
    processes = list(trainer.workers[0].processes)
    with pytest.raises(
        RankFailure, match=r"rank 0 failed during `rollout`.*forced verifier failure"
    ) as raised:
        trainer.train()
    assert all(not p.is_alive() for p in processes)
    # One paragraph (policy, rank, cause, how to resume); the rank's traceback in the run's error log.
    assert "\n" not in str(raised.value) and f"the full report is in {tmp_path / 'errors.log'}" in str(
        raised.value
    )
    report = (tmp_path / "errors.log").read_text()
    assert "Traceback (most recent call last)" in report and "ValueError: forced verifier failure" in report


@pytest.mark.distributed
def test_a_killed_rank_stops_the_run(tiny_checkpoints, tmp_path):
    def kill_rank_one(step: int, metrics: dict) -> None:
        if step == 0:
            os.kill(trainer.workers[0].processes[1].pid, signal.SIGKILL)

    trainer = Trainer(
        config_from_dict(one_policy_config(tiny_checkpoints)),
        tmp_path,
        verifier=TextRewards(),
        step_callback=kill_rank_one,
    )
    processes = list(trainer.workers[0].processes)
    with pytest.raises(RankFailure, match=r"rank 1 failed during `\w+`: killed by SIGKILL .*--resume"):
        trainer.train()
    assert all(not p.is_alive() for p in processes)
    assert "exited with code -9" in (tmp_path / "errors.log").read_text()


@pytest.mark.distributed
def test_gpt_neox_checkpoints_resume_into_and_from_shards(tmp_path):
    """GPT-NeoX's head is ``embed_out`` on disk and ``lm_head`` in memory: a one-device checkpoint
    loads into 2 ranks' shards, and a 2-rank run resumes from its DCP checkpoint, through the same
    transformers loading (issue 46); both end as the uninterrupted one-rank run."""
    from architectures import build_architecture, one_policy_config

    model = build_architecture("gpt_neox", tmp_path / "gpt_neox")

    def config(ranks: int, steps: int) -> dict:
        raw = one_policy_config(model, steps)
        raw["rollout"] = {"n": 4, "max_new_tokens": 4, "max_batch_size": 4}  # each rank samples one prompt
        raw["checkpoint"] = {"every": 1, "keep_last": 5}
        raw["policies"][0]["parallel"] = {"data": ranks}
        return raw

    def train(ranks: int, steps: int, run: Path, resume: bool = False) -> None:
        trainer = Trainer(config_from_dict(config(ranks, steps)), run, verifier=TextRewards())
        trainer.train(resume=resume)
        trainer.close()

    def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
        return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "policy" / "model.safetensors"))

    train(1, 3, tmp_path / "reference")
    for before in (1, 2):
        run = tmp_path / f"from_{before}_rank"
        train(before, 2, run)
        train(2, 3, run, resume=True)
        got, expected = weights(run, 3), weights(tmp_path / "reference", 3)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, atol=WEIGHT_ATOL, rtol=0, msg=key)
    start = weights(tmp_path / "reference", 1)
    assert any(not torch.equal(start[k], v) for k, v in weights(tmp_path / "reference", 3).items())
