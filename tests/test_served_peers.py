"""Served peers (docs/served-peer.md) on answers recorded from a real vLLM server.

The bodies are vLLM's (tests/fixtures/served, replayed by tests/served_replay.py); the faults
(429 / 503, no answer in time, a dead server, no log-probs, a wrong n, an unknown model) are what
a real endpoint does. The live vLLM server is the vllm tier's (tests/test_served_vllm.py).
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import TextRewards, make_config
from served_replay import ReplayServer, dead_url, recorded

from graftrl.config import config_from_dict
from graftrl.models.served import (
    RequestStats,
    SamplingRequest,
    ServedPeerClient,
    ServedPeerError,
    parse_choices,
    wait_until_serving,
)
from graftrl.reporting.analysis_report import render_markdown
from graftrl.reporting.analyze import analyze_run
from graftrl.storage.rundir import read_metrics
from graftrl.storage.store import TrajectoryStore
from graftrl.training.trainer import Trainer

SAMPLING = SamplingRequest(n=4, max_tokens=8, temperature=1.0, top_p=1.0)
PROMPT = next(iter(recorded()["completions"]))


def served_config(paths, url: str, steps: int = 2, **peer) -> dict:
    raw = make_config(paths, steps=steps)
    raw["policies"] = raw["policies"][:1]  # llama trains; gpt2 answers from the endpoint
    raw["peers"] = [
        {"name": "gpt2", "endpoint": url, "model": "gpt2", "template": "Q: {problem}\nA: ", **peer}
    ]
    return raw


def test_parsing_vllm_answers_drops_the_eos_log_prob_of_stopped_completions():
    body = recorded()["stopping"]
    completions = parse_choices(body, 48)
    stopped = [c for c in completions if c.finished]
    assert stopped and len(stopped) < 48
    for completion, choice in zip(completions, body["choices"], strict=True):
        tokens = choice["logprobs"]["token_logprobs"]
        if completion.finished:  # vLLM lists the EOS token last
            assert choice["logprobs"]["tokens"][-1] == "<eos>"
            assert completion.token_logprobs == tuple(tokens[:-1]) and completion.eos_logprob == tokens[-1]
        else:
            assert completion.token_logprobs == tuple(tokens) and completion.eos_logprob is None
        assert completion.text == choice["text"]
    with pytest.raises(ValueError, match="no token log-probs"):
        parse_choices(recorded()["no_logprobs"], 4)
    with pytest.raises(ValueError, match="2 completions for n = 4"):
        parse_choices(recorded()["two_completions"], 4)


@pytest.mark.parametrize(
    ("mode", "model", "message"),
    [
        ("replay", "nope", "does not serve model 'nope'.*it serves: gpt2"),
        ("no_logprobs", "gpt2", "returned no token log-probs"),
        ("wrong_n", "gpt2", "returned 2 completions for n = 4"),
    ],
)
def test_the_probe_refuses_an_endpoint_that_cannot_serve_the_run(mode, model, message):
    with ReplayServer(mode) as server:
        client = ServedPeerClient("gpt2", server.url, model)
        with pytest.raises(ServedPeerError, match=message) as error:
            client.probe(PROMPT, SAMPLING, "peers[gpt2]")
        assert "\n" not in str(error.value) and str(error.value).startswith("peers[gpt2]")
        client.close()


def test_a_dead_server_is_refused_before_any_model_loads(tiny_checkpoints, tmp_path, monkeypatch):
    import graftrl.models.memory as memory

    monkeypatch.setattr(
        memory, "check_before_loading", lambda config: pytest.fail("a model was about to load")
    )
    config = config_from_dict(served_config(tiny_checkpoints, dead_url(), retries=0))
    with pytest.raises(ServedPeerError, match=r"peers\[gpt2\]: endpoint .* gives no answer"):
        Trainer(config, tmp_path / "run", verifier=TextRewards())


def test_429_and_503_are_retried_with_backoff_up_to_the_limit():
    with ReplayServer(fail=[429, 503]) as server:
        client = ServedPeerClient("gpt2", server.url, "gpt2", retries=2, backoff_s=0.01)
        answers, stats = client.complete([PROMPT], SAMPLING, [0])
        assert answers[0] is not None and len(answers[0]) == 4
        assert (stats.requests, stats.retries, stats.missing) == (3, 2, 0)
        assert stats.completion_tokens == recorded()["completions"][PROMPT]["usage"]["completion_tokens"]
        server.fail = [503, 503, 503]
        answers, stats = client.complete([PROMPT], SAMPLING, [0])
        assert answers == [None] and (stats.requests, stats.retries, stats.missing) == (3, 2, 1)
        ((reason, prompts),) = stats.reasons.items()
        assert reason.startswith("HTTP 503") and reason.endswith("after 3 requests") and prompts == 1
        client.close()


def test_a_missing_prompts_reason_is_given_once_with_its_count():
    stats = RequestStats(prompts=5, missing=5)
    for reason in (
        "no answer (refused) after 3 requests",
        "HTTP 500",
        "no answer (refused) after 3 requests",
    ):
        stats.add_reason(reason)
    stats.add_reason("unanswered after step_timeout_s 1", 2)
    assert stats.why() == (
        "2 prompts: no answer (refused) after 3 requests; 2 prompts: unanswered after step_timeout_s 1; "
        "1 prompt: HTTP 500"
    )
    other = RequestStats(reasons={"HTTP 500": 2, "HTTP 502": 1})
    stats.merge(other)  # the run's totals count each reason over the steps
    assert stats.reasons["HTTP 500"] == 3 and stats.why(shown=2).endswith("; 2 other reasons")
    assert RequestStats().why() == ""


def test_the_step_timeout_leaves_prompts_missing():
    with ReplayServer("hang", hang_s=3.0) as server:
        client = ServedPeerClient("gpt2", server.url, "gpt2", step_timeout_s=0.5)
        answers, stats = client.complete([PROMPT, PROMPT], SAMPLING)
        assert answers == [None, None] and stats.missing == 2
        assert stats.reasons == {"unanswered after step_timeout_s 0.5": 2}
        assert stats.latency_s < 2.0
        client.close()


def test_the_key_is_sent_and_never_logged_or_written(tiny_checkpoints, tmp_path, monkeypatch, capsys):
    secret = "sk-served-peer-test-4242"
    monkeypatch.setenv("GRAFT_PEER_KEY", secret)
    with ReplayServer() as server:
        raw = served_config(tiny_checkpoints, server.url, steps=1, api_key_env="GRAFT_PEER_KEY")
        Trainer(config_from_dict(raw), tmp_path / "run", verifier=TextRewards()).train()
        assert {headers.get("Authorization") for headers, _ in server.requests} == {f"Bearer {secret}"}
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err
    monkeypatch.delenv("GRAFT_PEER_KEY")
    with pytest.raises(ServedPeerError, match="GRAFT_PEER_KEY is not set"):
        Trainer(config_from_dict(raw), tmp_path / "other", verifier=TextRewards())


def llama_all_fail(run) -> dict[int, list[str]]:
    """step -> the prompt ids on which llama failed all n (from its recorded groups)."""
    store = TrajectoryStore(run / "store")
    out: dict[int, list[str]] = {}
    for step in store.steps():
        groups: dict[str, list[float]] = {}
        for row in store.read_step(step, token_logprobs=False):
            if row.source == "llama":
                groups.setdefault(row.prompt_id, []).append(row.reward)
        out[step] = sorted(p for p, rewards in groups.items() if not any(rewards))
    return out


def test_a_served_peer_answers_only_all_fail_prompts_and_replays_as_a_stored_peer(tiny_checkpoints, tmp_path):
    with ReplayServer() as server:
        raw = served_config(tiny_checkpoints, server.url)
        raw["store"] = {"record": True}
        Trainer(config_from_dict(raw), tmp_path / "served", verifier=TextRewards()).train()
        asked = server.prompts()[1:]  # the first request is the start-up probe
    store = TrajectoryStore(tmp_path / "served" / "store")
    fails = llama_all_fail(tmp_path / "served")
    served = {
        step: sorted({row.prompt_id for row in store.read_step(step) if row.source == "gpt2"})
        for step in fails
    }
    assert served == fails and sum(map(len, fails.values())) == len(asked) > 0
    rows = read_metrics(tmp_path / "served")
    assert [row["served_prompts/gpt2"] for row in rows] == [len(fails[s]) for s in sorted(fails)]
    assert all(row["served_missing/gpt2"] == 0 and row["served_completion_tokens/gpt2"] > 0 for row in rows)
    # The same run with the recorded groups as a stored peer: the same plans, s, w and losses.
    stored = json.loads(json.dumps(raw))
    stored["peers"] = [{"name": "gpt2", "path": str(tmp_path / "served" / "store"), "partial": True}]
    stored["store"] = {"record": False}
    Trainer(config_from_dict(stored), tmp_path / "stored", verifier=TextRewards()).train()
    replayed = read_metrics(tmp_path / "stored")
    assert sum(row["peer_responses"] for row in rows) > 0, "the run should graft served groups"
    skip = ("time_", "memory_", "served_", "stored_", "complementarity/")
    for a, b in zip(rows, replayed, strict=True):
        keys = {k for k in b if not k.startswith(skip)}
        assert {k for k in a if not k.startswith(skip)} == keys
        for key in keys:
            if isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
            else:
                assert a[key] == b[key], key
    compat = [
        (tmp_path / run / "compatibility.jsonl").read_text().splitlines() for run in ("served", "stored")
    ]
    assert [json.loads(line) for line in compat[0]] == [json.loads(line) for line in compat[1]]
    # graftrl analyze: the served share of the exchange and its cost.
    (cost,) = analyze_run(tmp_path / "served").served
    assert cost.peer == "gpt2" and cost.totals["prompts"] == len(asked) and cost.totals["missing"] == 0
    assert cost.share == 1.0 and cost.transferred == sum(row["transferred/gpt2"] for row in rows)
    report = render_markdown(analyze_run(tmp_path / "served"), {})
    assert "## Served peers" in report and "served share" in report


def test_a_server_gone_mid_run_leaves_the_groups_on_the_receiver_and_says_so(
    tiny_checkpoints, tmp_path, capsys
):
    server = ReplayServer().__enter__()
    raw = served_config(tiny_checkpoints, server.url, steps=2, retries=1, backoff_s=0.01)
    trainer = Trainer(config_from_dict(raw), tmp_path / "run", verifier=TextRewards())
    server.stop()  # after the probe: every step's requests go unanswered
    trainer.train()
    rows = read_metrics(tmp_path / "run")
    assert all(row["served_missing/gpt2"] == row["served_prompts/gpt2"] for row in rows)
    assert sum(row["served_prompts/gpt2"] for row in rows) > 0
    assert all(row["peer_responses"] == 0 for row in rows)
    assert all(row["served_requests/gpt2"] == 2 * row["served_prompts/gpt2"] for row in rows)
    lines = [line for line in capsys.readouterr().err.splitlines() if "unanswered" in line]
    assert lines
    for line in lines:  # each distinct reason once, with the prompts it cost (issue 57)
        found = re.search(
            r"left (\d+) of \1 prompts unanswered \(\1 prompts?: (no answer \(.*\) after 2 requests)\)", line
        )
        assert found and line.count(found[2]) == 1, line


def test_graftrl_probe_measures_the_served_peers_answers_and_cost(tiny_checkpoints, tmp_path):
    from graftrl.experiments.probe import run_probe
    from graftrl.reporting.probe_stats import recount

    with ReplayServer() as server:
        config = config_from_dict(served_config(tiny_checkpoints, server.url))
        result = run_probe(config, tmp_path / "probe", 8, verifier=TextRewards(), progress=False)
        asked = len(server.prompts()) - 1  # less the start-up probe request
    served = result.figures["served"]["gpt2"]
    assert served["prompts"] == served["requests"] == asked > 0 and served["missing"] == 0
    assert served["completion_tokens"] > 0
    assert list(result.figures["models"]) == ["llama"]  # a served peer answers no shared batch
    assert recount(tmp_path / "probe") == result.figures
    assert "## Served peers" in (tmp_path / "probe" / "probe.md").read_text()
    samples = [json.loads(line) for line in (tmp_path / "probe" / "samples.jsonl").read_text().splitlines()]
    assert sum(s["model"] == "gpt2" for s in samples) == asked * 4  # its answers, no placeholders


def test_k_above_2_mixes_co_trained_stored_and_served_peers(tiny_checkpoints, tmp_path):
    with ReplayServer() as server:
        first = served_config(tiny_checkpoints, server.url)
        first["store"] = {"record": True}
        Trainer(config_from_dict(first), tmp_path / "first", verifier=TextRewards()).train()
        mixed = served_config(tiny_checkpoints, server.url)
        llama = dict(first["policies"][0], name="llama-b")
        mixed["policies"] = [llama, make_config(tiny_checkpoints)["policies"][1]]  # llama-b, gpt2
        mixed["peers"][0]["name"] = "served"
        mixed["peers"].append({"name": "llama", "path": str(tmp_path / "first" / "store")})  # stored
        Trainer(config_from_dict(mixed), tmp_path / "mixed", verifier=TextRewards()).train()
    rows = read_metrics(tmp_path / "mixed")
    assert {row["model"] for row in rows} == {"llama-b", "gpt2"}
    for row in rows:
        assert {"candidates/served", "candidates/llama", "served_prompts/served"} <= set(row)
        assert row["candidates/" + ("gpt2" if row["model"] == "llama-b" else "llama-b")] >= 0
    assert sum(row["served_prompts/served"] for row in rows) > 0


def test_the_cli_refuses_a_dead_endpoint_in_one_line_and_estimate_memory_names_the_peer(
    tiny_checkpoints, tmp_path
):
    import yaml
    from typer.testing import CliRunner

    from graftrl.cli import app

    path = tmp_path / "served.yaml"
    path.write_text(yaml.safe_dump(served_config(tiny_checkpoints, dead_url(), retries=0)))
    runner = CliRunner()
    result = runner.invoke(app, ["train", str(path), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "peers[gpt2]: endpoint" in lines[0] and "Traceback" not in result.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    result = runner.invoke(app, ["estimate-memory", str(path), "--gpu-memory", "80"])
    assert result.exit_code == 0 and "served peer gpt2: gpt2 at" in result.output
    bad = served_config(tiny_checkpoints, "127.0.0.1:8000")
    path.write_text(yaml.safe_dump(bad))
    result = runner.invoke(app, ["train", str(path), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "is not an http(s) URL" in result.output


def test_a_base_url_without_v1_is_refused_naming_the_fix():
    with ReplayServer() as server:
        client = ServedPeerClient("gpt2", server.url.removesuffix("/v1"), "gpt2")
        with pytest.raises(ServedPeerError, match="ends in /v1"):
            client.probe(PROMPT, SAMPLING, "peers[gpt2]")
        client.close()


def test_trls_served_peer_is_the_config_class_and_reads_the_old_placeholder_with_a_warning():
    from graftrl.config.peers import SERVED_RETRIES, ServedPeerConfig
    from graftrl.integrations.trl import ServedPeer

    assert ServedPeer is ServedPeerConfig
    peer = ServedPeer(endpoint="http://127.0.0.1:8000/v1", model="gpt2", name="gpt2")
    assert peer.template == "{problem}" and peer.retries == SERVED_RETRIES
    with pytest.warns(DeprecationWarning, match=r"\{prompt\} placeholder is deprecated"):
        old = ServedPeer(endpoint="http://127.0.0.1:8000/v1", model="gpt2", name="gpt2", template="Q: {prompt}")
    assert old.template == "Q: {problem}"
    with pytest.raises(ValueError, match=r"no \{problem\} placeholder"):
        ServedPeer(endpoint="http://127.0.0.1:8000/v1", model="gpt2", name="gpt2", template="Q:")


@pytest.mark.usefixtures("ray_ships_test_helpers")
def test_a_served_peer_under_the_ray_backend_gives_the_local_run(tiny_checkpoints, tmp_path):
    pytest.importorskip("ray")
    runs = {}
    for backend in ("local", "ray"):
        with ReplayServer() as server:
            raw = served_config(tiny_checkpoints, server.url)
            raw["backend"] = backend
            Trainer(config_from_dict(raw), tmp_path / backend, verifier=TextRewards()).train()
        runs[backend] = [
            {
                k: v
                for k, v in row.items()
                if not k.startswith(("time_", "memory_")) and k != "served_latency_s/gpt2"
            }
            for row in read_metrics(tmp_path / backend)
        ]
    # Floats to float32 reduction noise: a process that once ran torch on 2 threads (an in-process
    # CLI test before this one) reduces in another order than the Ray actors' fresh processes, even
    # back on 1 thread; the plans, counts and served answers must be identical.
    assert len(runs["ray"]) == len(runs["local"]) and sum(r["served_prompts/gpt2"] for r in runs["ray"]) > 0
    for ray_row, local_row in zip(runs["ray"], runs["local"], strict=True):
        assert ray_row.keys() == local_row.keys()
        for key, value in local_row.items():
            if isinstance(value, float):
                assert ray_row[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (local_row["step"], key)
            else:
                assert ray_row[key] == value, (local_row["step"], key)


def test_the_documented_config_is_a_served_peer():
    import re
    from pathlib import Path

    import yaml

    doc = (Path(__file__).parents[1] / "docs" / "served-peer.md").read_text()
    (block,) = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    (peer,) = config_from_dict(yaml.safe_load(block)).peers
    assert peer.served and peer.endpoint.endswith("/v1") and peer.api_key_env == "PEER_API_KEY"


def test_waiting_for_a_server_ends_when_it_answers_or_gives_up():
    import time

    with ReplayServer() as server:
        assert wait_until_serving(server.url, 5)
    started = time.monotonic()
    assert not wait_until_serving(dead_url(), 60, running=lambda: time.monotonic() - started < 1.5)
    assert time.monotonic() - started < 10  # `running` turning false stops the wait
