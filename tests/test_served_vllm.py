"""A served peer against vLLM's own OpenAI-compatible server on CPU (vLLM tier, its environment).

The server serves conftest's GPT-2; the Llama trains against it with GRAFT. The server is killed
after the first step (the next step's answers are missing: the groups stay on the receiver) and
started again (the run goes on with answers). The run's store then replays the served groups as a
stored peer (``partial: true``): every step gives the same plan, s, w and loss.

Run: `.venv-vllm/bin/python -m pytest -m vllm tests/test_served_vllm.py`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TextRewards, make_config

from graftrl.config import config_from_dict
from graftrl.models.served import wait_until_serving
from graftrl.storage.rundir import read_metrics
from graftrl.training.trainer import Trainer

pytestmark = pytest.mark.vllm


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


DOC = Path(__file__).parents[1] / "docs" / "served-peer.md"


def documented_serve(model: Path, port: int) -> list[str]:
    """docs/served-peer.md's CPU server command, with this test's model, port and a context the tiny
    model has (its max_position_embeddings is 512)."""
    (block,) = re.findall(r"```bash\n(python -m vllm[^`]*?)\n```", DOC.read_text())
    args = [str(model) if arg == "PEER_MODEL_FOLDER" else arg for arg in shlex.split(block)]
    args[args.index("--port") + 1] = str(port)
    args[args.index("--max-model-len") + 1] = "256"
    return [sys.executable, *args[1:]]


def serve(model: Path, port: int, log: Path) -> subprocess.Popen:
    """The documented `vllm serve`; returns once /v1/models answers."""
    command = documented_serve(model, port)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    process = subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)
    if wait_until_serving(f"http://127.0.0.1:{port}/v1", 300, lambda: process.poll() is None):
        return process
    if process.poll() is not None:
        pytest.fail(f"vllm serve exited with {process.returncode}: {log.read_text()[-2000:]}")
    process.kill()
    pytest.fail(f"vllm serve not ready in 300 s: {log.read_text()[-2000:]}")


def test_graft_against_a_vllm_server_survives_its_death_and_replays_as_stored(vllm_checkpoints, tmp_path):
    port = free_port()
    log = tmp_path / "vllm.log"
    server = serve(vllm_checkpoints["gpt2"], port, log)
    raw = make_config(vllm_checkpoints, steps=3)
    raw["policies"] = raw["policies"][:1]
    raw["peers"] = [
        {
            "name": "gpt2",
            "endpoint": f"http://127.0.0.1:{port}/v1",
            "model": "peer",  # the doc's --served-model-name
            "template": "Q: {problem}\nA: ",
            "retries": 1,
            "backoff_s": 0.1,
        }
    ]
    raw["store"] = {"record": True}
    servers = [server]

    def kill_then_restart(step: int, metrics: dict) -> None:
        if step == 0:
            servers[-1].kill()
            servers[-1].wait()
        if step == 1:
            servers.append(serve(vllm_checkpoints["gpt2"], port, log))

    try:
        Trainer(
            config_from_dict(raw),
            tmp_path / "served",
            verifier=TextRewards(),
            step_callback=kill_then_restart,
        ).train()
    finally:
        servers[-1].kill()
        servers[-1].wait()
    rows = read_metrics(tmp_path / "served")
    asked = [row["served_prompts/gpt2"] for row in rows]
    missing = [row["served_missing/gpt2"] for row in rows]
    assert asked[1] > 0 and missing == [0, asked[1], 0], (asked, missing)
    assert rows[1]["peer_responses"] == 0  # the dead step trains on the receiver's own groups
    assert all(row["served_completion_tokens/gpt2"] > 0 for i, row in enumerate(rows) if i != 1 and asked[i])

    stored = json.loads(json.dumps(raw))
    stored["peers"] = [{"name": "gpt2", "path": str(tmp_path / "served" / "store"), "partial": True}]
    stored["store"] = {"record": False}
    Trainer(config_from_dict(stored), tmp_path / "stored", verifier=TextRewards()).train()
    skip = ("time_", "memory_", "served_", "stored_", "complementarity/")
    for a, b in zip(rows, read_metrics(tmp_path / "stored"), strict=True):
        keys = {k for k in b if not k.startswith(skip)}
        assert {k for k in a if not k.startswith(skip)} == keys
        for key in keys:
            expected = pytest.approx(b[key], rel=1e-6, abs=1e-9) if isinstance(b[key], float) else b[key]
            assert a[key] == expected, key
    compat = [
        (tmp_path / run / "compatibility.jsonl").read_text().splitlines() for run in ("served", "stored")
    ]
    assert [json.loads(line) for line in compat[0]] == [json.loads(line) for line in compat[1]]
