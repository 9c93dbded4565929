"""The demo's cell under graftrl's malloc settings and under glibc's, side by side.

Each pair starts two processes at once, one torch thread each (as ``graftrl demo`` runs its cells),
one with ``GRAFTRL_MALLOC=default``; each trains STEPS steps of the demo's METHOD cell on the
cached embedded pair and prints its wall time, CPU-seconds and minor page faults. Running the two
side by side gives both the same machine load, which drifts by more than the effect measured.

    PYTHONPATH=src .venv/bin/python benchmarks/allocator_cells.py --method graft --steps 8 --pairs 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def one_cell(method: str, steps: int, root: Path) -> dict[str, float]:
    """Train the demo's cell for ``steps`` steps in this process; its wall, CPU and page faults."""
    import resource
    import time
    from dataclasses import replace

    import torch

    from graftrl.config import config_from_dict
    from graftrl.embedded.base import demo_config, demo_settings, write_problems
    from graftrl.embedded.task import DEFAULT_TASK, make_split
    from graftrl.embedded.warmstart import prepare_embedded_models
    from graftrl.machine import tune_allocator
    from graftrl.models.rewards import MathVerifier
    from graftrl.training.trainer import Trainer

    tuned = tune_allocator()
    torch.set_num_threads(1)
    settings = replace(demo_settings(DEFAULT_TASK), steps=steps)
    paths = prepare_embedded_models(
        Path.home() / ".cache" / "graftrl" / "embedded", seed=0, task=DEFAULT_TASK
    )
    train, _ = make_split(seed=0, n_train=settings.n_train, n_eval=settings.n_eval, task=DEFAULT_TASK)
    write_problems(train, root / "train.jsonl")
    raw = demo_config(paths, root / "train.jsonl", method, 0, settings)
    raw["logging"] = {"progress": False, "log_samples": 1}
    with MathVerifier() as verifier:
        trainer = Trainer(config_from_dict(raw), root / "run", verifier=verifier)
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        trainer.train()
        after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {
        "malloc": "graftrl's" if tuned else "glibc's default",
        "wall_s": time.perf_counter() - start,
        "cpu_s": cpu,
        "page_faults": after.ru_minflt - before.ru_minflt,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="graft")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_cell(args.method, args.steps, Path(args.child))))
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    with tempfile.TemporaryDirectory(prefix="graftrl-allocator-") as tmp:
        for pair in range(args.pairs):
            runs = []
            for setting in ("graftrl", "default"):
                root = Path(tmp) / f"{setting}-{pair}"
                command = [sys.executable, __file__, "--method", args.method, "--steps", str(args.steps)]
                runs.append(
                    subprocess.Popen(
                        [*command, "--child", str(root)],
                        env={**env, "GRAFTRL_MALLOC": setting},
                        stdout=subprocess.PIPE,
                        stderr=subprocess.DEVNULL,
                        text=True,
                    )
                )
            for run in runs:
                out, _ = run.communicate()
                r = json.loads(out.strip().splitlines()[-1])
                print(
                    f"pair {pair}: {r['malloc']:>15}  wall {r['wall_s']:6.1f} s  CPU {r['cpu_s']:6.1f} s  "
                    f"page faults {r['page_faults']:>9,}"
                )


if __name__ == "__main__":
    main()
