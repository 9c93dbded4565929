"""What a served peer costs per step against a co-trained peer's rollouts, on the embedded pair.

The demo's configuration (``demo_config``: the warm-started char Llama and BPE GPT-2, GRAFT) runs
``--steps`` steps twice from the same weights and seed:

- co-trained: both models are policies; the GPT-2 samples ``batch_prompts x n`` responses per
  step (its rollouts: sequences and tokens, from its metrics) and is updated;
- served: the GPT-2 is served by vLLM's OpenAI-compatible server (``vllm serve``, started here on
  a free port, as docs/served-peer.md does on CPU) and the Llama trains against it: the server is asked only the Llama's all-fail
  prompts, n completions each (the ``served_*`` metrics: requests, prompts, tokens requested and
  received, missing).

It prints one row per step and the means. Needs vLLM (``.venv-vllm``):

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv-vllm/bin/python benchmarks/served_peer_cost.py --steps 3
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--task", default="worked", help="embedded task whose pair and data are used")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument(
        "--cache-dir", default=None, help="embedded model cache (default ~/.cache/graftrl/embedded)"
    )
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return ap.parse_args(argv)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(model: Path, port: int, context: int, log: Path) -> subprocess.Popen:
    """vLLM's OpenAI-compatible server as docs/served-peer.md starts it on CPU; returns once /v1/models answers."""
    from graftrl.models.served import wait_until_serving

    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "peer",
        "--port", str(port), "--max-model-len", str(context), "--dtype", "float32",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    if wait_until_serving(f"http://127.0.0.1:{port}/v1", 600, lambda: process.poll() is None):
        return process
    process.kill()
    raise RuntimeError(f"vllm serve did not start: {log.read_text()[-2000:]}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    C.set_threads(args.threads)
    C.quiet_hf()
    from graftrl.config import config_from_dict
    from graftrl.embedded.task import make_split
    from graftrl.experiments.compare.task import demo_config, demo_settings, write_problems
    from graftrl.models.rewards import MathVerifier
    from graftrl.training.trainer import Trainer

    settings = demo_settings(args.task)
    paths = C.embedded_paths(args.cache_dir, args.task)
    work = Path(tempfile.mkdtemp(prefix="served_peer_cost-"))
    train, _ = make_split(seed=0, n_train=settings.n_train, n_eval=settings.n_eval, task=args.task)
    write_problems(train, work / "train.jsonl")
    raw = demo_config(paths, work / "train.jsonl", "graft", 0, settings)
    raw["train"]["steps"] = args.steps
    raw["logging"] = {"progress": False, "log_samples": 0}
    receiver, peer = raw["policies"]
    n, prompts = raw["rollout"]["n"], raw["train"]["batch_prompts"]

    port = free_port()
    server = serve(Path(peer["path"]), port, 96, work / "vllm.log")  # the embedded models' context
    rows: list[dict[str, Any]] = []
    try:
        with MathVerifier.from_config(config_from_dict(raw).reward) as verifier:
            co = {}

            def keep_co(step: int, metrics: dict) -> None:
                co[step] = metrics[peer["name"]]

            Trainer(config_from_dict(raw), work / "co", verifier=verifier, step_callback=keep_co).train()
            served_raw = {
                **raw,
                "policies": [receiver],
                "peers": [
                    {
                        "name": peer["name"],
                        "endpoint": f"http://127.0.0.1:{port}/v1",
                        "model": "peer",
                        "template": peer["template"],
                    }
                ],
            }
            served = {}

            def keep_served(step: int, metrics: dict) -> None:
                served[step] = metrics[receiver["name"]]

            Trainer(
                config_from_dict(served_raw), work / "served", verifier=verifier, step_callback=keep_served
            ).train()
    finally:
        server.kill()
        server.wait()
    name = peer["name"]
    for step in range(args.steps):
        c, s = co[step], served[step]
        rows.append(
            {
                "step": step,
                "co_prompts": prompts,
                "co_sequences": prompts * n,
                "co_tokens": c["response_length"] * prompts * n,
                "co_rollout_s": c["time_rollout"],
                "receiver_all_fail": s["all_fail_frac"],
                "served_prompts": s[f"served_prompts/{name}"],
                "served_requests": s[f"served_requests/{name}"],
                "served_sequences": s[f"served_prompts/{name}"] * n,
                "served_prompt_tokens": s[f"served_prompt_tokens/{name}"],
                "served_completion_tokens": s[f"served_completion_tokens/{name}"],
                "served_missing": s[f"served_missing/{name}"],
                "served_latency_s": s[f"served_latency_s/{name}"],
            }
        )
    headers = list(rows[0])
    means = {k: C.mean(r[k] for r in rows) for k in headers if k != "step"}
    print(
        C.table(
            headers,
            [[r[k] for k in headers] for r in rows] + [["mean", *[means[k] for k in headers[1:]]]],
            title=f"served vs co-trained peer ({name}) per step, {prompts} prompts x n = {n}",
        )
    )
    share = means["served_sequences"] / means["co_sequences"]
    print(
        f"the served peer generated {share:.1%} of the co-trained peer's sequences "
        f"({means['served_completion_tokens']:.0f} vs {means['co_tokens']:.0f} tokens per step); "
        "requests went only to the receiver's all-fail prompts"
    )
    payload = {"rows": rows, "means": means, "machine": C.machine_info()}
    C.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
