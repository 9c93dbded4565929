"""FSDP2 data parallelism inside a policy: per-rank peak memory and step time vs ranks N.

Builds a random-init char-level Llama (default hidden 512, 6 layers: ~19M parameters, so its
float32 weights + gradients + AdamW state, 16 bytes per parameter, dominate a rank's memory),
and runs graftrl's Trainer (method grpo, one policy) with ``policies[].parallel.data: N`` for each
N. Rewards are a fixed function of the response text (about half correct), so every step trains.

Per N it prints the median step time (after a warm-up step), the rollout and update phases,
and the peak memory of the largest rank during a step (VmHWM on CPU, reset every step;
``torch.cuda.max_memory_allocated`` on GPUs), next to the sharded training state 16 P / N.
On CPU a rank's peak also holds the interpreter, torch and transformers (~0.4-0.5 GB) and, during
sampling and peer scoring, the gathered full weights (4 P bytes).

    PYTHONPATH=src python benchmarks/fsdp_scaling.py                    # CPU, N = 1, 2 (1 thread each)
    PYTHONPATH=src python benchmarks/fsdp_scaling.py --device cuda --ranks 1,2,4 --hidden 1024 --layers 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C


class HalfRewards:
    """About half the responses correct, as a pure function of the text (every rank alike)."""

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        return [float(zlib.crc32(r.encode()) % 2 == 0) for r in responses]

    def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", default="1,2", help="comma-separated N values")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="compute dtype (bfloat16 on GPUs)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch-prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--steps", type=int, default=3, help="steps per N; the first is a warm-up")
    parser.add_argument("--json", default=None, help="also write the table (headers, rows) to this file")
    args = parser.parse_args()
    C.set_threads(1)
    C.quiet_hf()

    from graftrl.config import config_from_dict
    from graftrl.embedded.models import build_char_tokenizer, build_model
    from graftrl.storage.data import load_problems
    from graftrl.storage.rundir import read_metrics
    from graftrl.training.trainer import Trainer

    data = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "math_small.jsonl"
    rows = []
    with tempfile.TemporaryDirectory(prefix="graftrl-fsdp-") as folder:
        root = Path(folder)
        tokenizer = build_char_tokenizer()
        model = build_model(
            "llama", tokenizer, hidden=args.hidden, layers=args.layers, heads=8, max_positions=512, seed=1
        )
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(root / "model")
        tokenizer.save_pretrained(root / "model")
        del model
        for ranks in [int(r) for r in args.ranks.split(",")]:
            raw = {
                "method": "grpo",
                "seed": 1,
                "policies": [
                    {
                        "name": "policy",
                        "path": str(root / "model"),
                        "template": "{problem}=",
                        "device": args.device,
                        "dtype": args.dtype,
                        "parallel": {"data": ranks},
                    }
                ],
                "data": {"train": str(data), "prompt_suffix": None},
                "rollout": {
                    "n": args.n,
                    "max_new_tokens": args.max_new_tokens,
                    # One generate chunk per rank for the largest N.
                    "max_batch_size": max(args.n, args.batch_prompts * args.n // max(1, ranks)),
                },
                "train": {
                    "steps": args.steps,
                    "batch_prompts": args.batch_prompts,
                    "minibatch_prompts": args.batch_prompts // 2,
                    "micro_batch_size": args.batch_prompts * args.n,
                },
                "optim": {"lr": 1e-4},
                "checkpoint": {"every": 0},
                "logging": {"progress": False, "log_samples": 0},
            }
            run = root / f"run_{ranks}"
            start = time.perf_counter()
            trainer = Trainer(
                config_from_dict(raw), run, problems=load_problems(data), verifier=HalfRewards()
            )
            trainer.train()
            total = time.perf_counter() - start
            metrics = read_metrics(run)[1:]  # after the warm-up step
            rows.append(
                [
                    ranks,
                    statistics.median(m["time_step"] for m in metrics),
                    statistics.median(m["time_rollout"] for m in metrics),
                    statistics.median(m["time_update"] for m in metrics),
                    max(m["memory_peak_mb"] for m in metrics),
                    16 * params / ranks / 2**20,
                    total,
                ]
            )
    base_time, base_memory = rows[0][1], rows[0][4]
    for row in rows:
        row += [row[1] / base_time, row[4] / base_memory]
    headers = [
        "N",
        "step s",
        "rollout s",
        "update s",
        "peak MB / rank",
        "16P/N MB",
        "run s (incl. start)",
        "step ratio",
        "memory ratio",
    ]
    title = (
        f"{params / 1e6:.1f}M parameters, {args.device}, {args.dtype}, "
        f"{args.batch_prompts} prompts x n = {args.n}, {args.max_new_tokens} new tokens"
    )
    print(C.table(headers, rows, title=title))
    C.write_json(
        args.json,
        {"args": vars(args), "machine": C.machine_info(), "title": title, "headers": headers, "rows": rows},
    )


if __name__ == "__main__":
    main()
