"""Warm-start one embedded model on a candidate family mix, then measure it on training-side problems.

The design tool behind docs/task_design.md's mastery knob: warm-starts ``--spec`` on ``--mix`` (a
JSON mapping family -> weight, drills included; ``graftrl.embedded.warmstart.warm_start``, stop at
``--target`` sampled accuracy or ``--max-steps``), or takes an existing model folder (``--path``),
then samples n = 8 responses at T = 1 for 128 fresh problems per family (fewer for a drill) and
prints per family: accuracy, all-fail and mixed-group shares, and the share of each error class
among the wrong samples (``embedded.task.classify_worked``: regrouping, fact, copy, format).
Never the held-out set.

    PYTHONPATH=src python scripts/explore_warmstart.py --spec llama-char --out /tmp/L_e0.03 \
        --mix '{"add":0.3,"add_carry":0.03,"sub":0.225,"add_fact":0.15,"sub_fact":0.15}' --target 0.7 --max-steps 800
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

FAMILIES = ("add", "add_carry", "sub", "sub_borrow")


def measure(
    spec: str, path: Path, families: list[str], n: int = 8, per_family: int = 128, seed: int = 0
) -> dict:
    from graftrl.embedded.models import MODEL_SPECS
    from graftrl.embedded.task import WORKED_OUTCOMES, classify_worked, get_task, make_problems
    from graftrl.models.policy import Policy
    from graftrl.models.rewards import MathVerifier
    from graftrl.models.rollout import HFRolloutEngine, SamplingParams

    task = get_task("worked")
    policy = Policy.from_pretrained(spec, str(path), template=MODEL_SPECS[spec]["template"])
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=task.max_new_tokens)
    out = {}
    with MathVerifier() as verifier:
        for j, family in enumerate(families):
            count = min(per_family, task.family(family).distinct or per_family)
            problems = make_problems([family], count, seed=424_242 + j, task="worked")
            batch = HFRolloutEngine().generate(policy, [p.problem for p in problems], params, seed=seed)
            rewards = verifier.score(batch.texts, [p.answer for p in problems for _ in range(n)])
            wrong = Counter(
                classify_worked(problems[i // n].problem, text)
                for i, text in enumerate(batch.texts)
                if not rewards[i]
            )
            k = torch.tensor(rewards).view(-1, n).sum(-1)
            out[family] = {
                "accuracy": round(sum(rewards) / len(rewards), 3),
                "all_fail": round(float((k == 0).float().mean()), 3),
                "mixed": round(float(((k > 0) & (k < n)).float().mean()), 3),
                "wrong": {c: round(wrong[c] / max(sum(wrong.values()), 1), 3) for c in WORKED_OUTCOMES[1:]},
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="llama-char or gpt2-bpe")
    ap.add_argument("--mix", default="{}", help="JSON family -> weight (with --out)")
    ap.add_argument("--out", type=Path, help="where the warm-started model is written (reused if there)")
    ap.add_argument("--path", type=Path, help="measure this model folder instead of warm-starting")
    ap.add_argument("--target", type=float, default=0.7)
    ap.add_argument("--max-steps", type=int, default=800)
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from graftrl.embedded.warmstart import REPORT_NAME, warm_start

    mix = json.loads(args.mix)
    started = time.process_time()
    path = args.path or args.out
    if path is None:
        raise SystemExit("give --out (warm-start) or --path (measure an existing model)")
    if args.path is None and not (path / REPORT_NAME).exists():
        warm_start(
            args.spec,
            mix,
            path,
            seed=0,
            target_accuracy=args.target,
            max_steps=args.max_steps,
            max_seconds=1e9,
            task="worked",
        )
    report = json.loads((path / REPORT_NAME).read_text())
    drills = [f for f in ("add_fact", "sub_fact") if f in report["mix"]]
    result = {
        "warm_start": {
            k: report[k] for k in ("fingerprint", "mix", "steps", "mix_accuracy", "reached_target")
        },
        "families": measure(args.spec, path, [*FAMILIES, *drills]),
        "cpu_s": round(time.process_time() - started, 1),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
