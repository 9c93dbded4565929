"""Write the embedded pair's run config and its training data: a config like your own pair's.

The demo's cell config (``reporting.compare_task.demo_config``: the warm-started char-level Llama
and BPE GPT-2, the demo's RL settings, GRAFT) on the demo's procedural training problems, so
`graftrl probe`, `graftrl train` and the other commands on a config run on the embedded pair.

    .venv/bin/python scripts/embedded_config.py --out runs/embedded     # writes runs/embedded/embedded.yaml
    .venv/bin/graftrl probe runs/embedded/embedded.yaml --prompts 256
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/embedded", help="folder for embedded.yaml and data/train.jsonl")
    ap.add_argument("--task", default="worked", help="embedded task (its pair, data and sizes)")
    ap.add_argument("--method", default="graft")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "graftrl" / "embedded"))
    args = ap.parse_args()

    import yaml

    from graftrl.embedded.task import make_split
    from graftrl.embedded.warmstart import prepare_embedded_models
    from graftrl.reporting.compare_task import demo_config, demo_settings, write_problems

    out = Path(args.out)
    settings = demo_settings(args.task)
    paths = prepare_embedded_models(args.cache_dir, task=args.task)
    train, _ = make_split(seed=0, n_train=settings.n_train, n_eval=settings.n_eval, task=args.task)
    write_problems(train, out / "data" / "train.jsonl")
    raw = demo_config(paths, (out / "data" / "train.jsonl").resolve(), args.method, args.seed, settings)
    (out / "embedded.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    print(out / "embedded.yaml")


if __name__ == "__main__":
    main()
