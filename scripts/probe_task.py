"""Probe an embedded task's exchange regime on the warm-started pair (training prompts only).

Loads (or warm-starts, cached) the two embedded models for ``--task``, samples n responses per
prompt on ``--prompts`` RL *training* prompts (never the held-out set), and prints per model and
per family: accuracy, all-fail share, mixed-group share; per direction: complementarity, transfer
candidates and the balanced selection; and the compatibility score s of the transferred responses
(all, correct, wrong) with the share the delta gate admits; for the groups the balanced selection
moves, the step each wrong response gets wrong first (``embedded.task.classify_worked``:
regrouping, fact, copy, format) and their contrast on the receiver's tokenization
(``core.contrast``: overlap, divergence, the lesson share, the advantage mass split). It uses
graftrl's own functions (the rollout engine, the verifier, ``Policy.encode_response`` /
``Policy.score``, ``content_mean_logprob``, ``core.compatibility_score``,
``core.balanced_selection``, ``core.group_contrast``), i.e. the numbers GRAFT's first step would see.

    PYTHONPATH=src python scripts/probe_task.py --task worked --prompts 128
    PYTHONPATH=src python scripts/probe_task.py --task worked --mastery 0.03   # a mastery point's pair
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def _quantiles(values: list[float]) -> str:
    if not values:
        return "-"
    v = sorted(values)
    q = [v[min(len(v) - 1, int(f * len(v)))] for f in (0.1, 0.25, 0.5, 0.75, 0.9)]
    return "p10/25/50/75/90 " + "/".join(f"{x:.2f}" for x in q)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="worked")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "graftrl" / "embedded"))
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--delta", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--examples", type=int, default=2, help="token-level examples to print per direction")
    ap.add_argument("--json", default=None, help="also write the numbers to this file")
    ap.add_argument(
        "--graft-steps",
        type=int,
        default=0,
        help="then train GRAFT this many steps (the demo's settings) and print the regime per step",
    )
    ap.add_argument("--run-dir", default="runs/probe_task", help="where the --graft-steps run is written")
    ap.add_argument(
        "--mastery",
        default="default",
        help="the pair of `graftrl sweep --knob mastery`'s point (default: the task's own pair)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from graftrl.core import (
        balanced_selection,
        compatibility_score,
        compatibility_weight,
        complementarity,
        grpo_advantages,
        transfer_candidates,
    )
    from graftrl.core.contrast import GroupContrast, contrast_metrics, group_contrast
    from graftrl.embedded.models import MODEL_SPECS
    from graftrl.embedded.task import WORKED_OUTCOMES, classify_worked, get_task, make_split
    from graftrl.embedded.warmstart import MASTERY_WARMSTART, mastery_mixes, prepare_embedded_models
    from graftrl.models.policy import Policy
    from graftrl.models.rewards import MathVerifier
    from graftrl.models.rollout import HFRolloutEngine, SamplingParams, content_mean_logprob

    task = get_task(args.task)
    start = time.perf_counter()
    drilled = args.mastery != "default"
    paths = prepare_embedded_models(
        args.cache_dir,
        task=args.task,
        mixes=mastery_mixes(args.task, args.mastery) if drilled else None,
        settings=MASTERY_WARMSTART if drilled else None,
    )
    print(f"models ready in {time.perf_counter() - start:.0f}s: {paths}")
    train, _ = make_split(seed=0, n_train=1200, n_eval=256, task=args.task)
    problems = train[: args.prompts]
    families = [p.family for p in problems]
    policies = {
        name: Policy.from_pretrained(name, str(path), template=MODEL_SPECS[name]["template"])
        for name, path in paths.items()
    }
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=task.max_new_tokens)
    engine = HFRolloutEngine()
    batches, rewards = {}, {}
    with MathVerifier() as verifier:
        for name, policy in policies.items():
            t = time.perf_counter()
            batch = engine.generate(policy, [p.problem for p in problems], params, seed=args.seed)
            golds = [p.answer for p in problems for _ in range(args.n)]
            batches[name] = batch
            rewards[name] = torch.tensor(verifier.score(batch.texts, golds)).view(len(problems), args.n)
            print(f"{name}: sampled {len(batch.texts)} in {time.perf_counter() - t:.0f}s")
    out: dict = {"task": args.task, "prompts": len(problems), "n": args.n, "models": {}, "directions": {}}
    names = list(policies)
    for name in names:
        r = rewards[name]
        k = r.sum(-1)
        per_family = {}
        for fam in sorted(set(families)):
            idx = torch.tensor([f == fam for f in families])
            per_family[fam] = {
                "acc": round(float(r[idx].mean()), 3),
                "all_fail": round(float((k[idx] == 0).float().mean()), 3),
                "mixed": round(float(((k[idx] > 0) & (k[idx] < args.n)).float().mean()), 3),
            }
        out["models"][name] = {
            "acc": round(float(r.mean()), 3),
            "all_fail": round(float((k == 0).float().mean()), 3),
            "all_pass": round(float((k == args.n).float().mean()), 3),
            "per_family": per_family,
        }
        print(f"\n{name}: acc {float(r.mean()):.3f}, all-fail {float((k == 0).float().mean()):.3f}")
        for fam, d in per_family.items():
            print(f"   {fam:12s} {d}")
    k_a, k_b = rewards[names[0]].sum(-1), rewards[names[1]].sum(-1)
    a_to_b, b_to_a = balanced_selection(k_a, k_b, args.n)
    for source, receiver, selected in ((names[0], names[1], a_to_b), (names[1], names[0], b_to_a)):
        k_src, k_rcv = rewards[source].sum(-1), rewards[receiver].sum(-1)
        cand = transfer_candidates(k_rcv, k_src, args.n)
        comp = float(complementarity(k_rcv, k_src))
        # Score every candidate group's responses on the receiver (what GRAFT would transfer
        # without balancing); the balanced subset is reported separately.
        rows = [p * args.n + i for p in cand.nonzero().flatten().tolist() for i in range(args.n)]
        src_batch, rcv_policy = batches[source], policies[receiver]
        prompt_ids = rcv_policy.encode_prompts([problems[row // args.n].problem for row in rows])
        responses = [
            rcv_policy.encode_response(src_batch.texts[row], src_batch.finished[row]) for row in rows
        ]
        scored = rcv_policy.score(prompt_ids, responses) if rows else []
        rcv_mean = torch.tensor(
            [content_mean_logprob(lp, src_batch.finished[row]) for lp, row in zip(scored, rows, strict=True)]
        )
        src_mean = torch.tensor([src_batch.content_mean_logprob(row) for row in rows])
        s = compatibility_score(rcv_mean, src_mean) if rows else torch.zeros(0)
        correct = torch.tensor([bool(rewards[source].view(-1)[row]) for row in rows], dtype=torch.bool)
        in_selection = torch.tensor([bool(selected[row // args.n]) for row in rows], dtype=torch.bool)
        admitted = s > args.delta

        def share(mask: torch.Tensor, admitted: torch.Tensor = admitted) -> float | None:
            return round(float(admitted[mask].float().mean()), 3) if bool(mask.any()) else None

        d = {
            "complementarity": round(comp, 3) if comp == comp else None,
            "candidates": int(cand.sum()),
            "selected_balanced": int(selected.sum()),
            "transferred": len(rows),
            "admit_all": share(torch.ones_like(correct)),
            "admit_correct": share(correct),
            "admit_wrong": share(~correct),
            "admit_balanced": share(in_selection),
            "s_correct": _quantiles(s[correct].tolist()),
            "s_wrong": _quantiles(s[~correct].tolist()),
            "src_mean_logp": round(float(src_mean.mean()), 3) if rows else None,
            "rcv_mean_logp": round(float(rcv_mean.mean()), 3) if rows else None,
            "families": {
                f: sum(1 for p in cand.nonzero().flatten().tolist() if families[p] == f)
                for f in sorted(set(families))
            },
        }
        # What GRAFT's balanced selection would move: the error classes of the wrong responses
        # (worked task) and the contrast of each moved group on the receiver's tokenization.
        moved = [j for j, row in enumerate(rows) if bool(in_selection[j])]
        if args.task == "worked":
            classes = [
                classify_worked(problems[rows[j] // args.n].problem, src_batch.texts[rows[j]])
                for j in moved
                if not bool(correct[j])
            ]
            d["moved_wrong_classes"] = {
                c: round(classes.count(c) / max(len(classes), 1), 3) for c in WORKED_OUTCOMES[1:]
            }
            d["moved_wrong"] = len(classes)
        advantages = grpo_advantages(rewards[source])
        weights = compatibility_weight(s, args.delta)
        total = GroupContrast()
        for p in sorted({rows[j] // args.n for j in moved}):
            members = [j for j in moved if rows[j] // args.n == p]
            finished = [src_batch.finished[rows[j]] for j in members]
            total += group_contrast(
                [responses[j][:-1] if f else responses[j] for j, f in zip(members, finished, strict=True)],
                [bool(correct[j]) for j in members],
                [float(weights[j] * advantages[p, rows[j] % args.n]) for j in members],
                logprobs=[scored[j].tolist() for j in members],
            )
        d["contrast"] = {
            k: round(v, 3) if isinstance(v, float) else v for k, v in contrast_metrics(total).items()
        }
        out["directions"][f"{source}->{receiver}"] = d
        print(f"\n{source} -> {receiver}: " + json.dumps(d, indent=1))
        shown = 0
        for j, row in enumerate(rows):
            if shown >= args.examples or not bool(correct[j]):
                continue
            shown += 1
            toks = rcv_policy.tokenizer.convert_ids_to_tokens(responses[j])
            pairs = " ".join(f"{t}:{v:.1f}" for t, v in zip(toks, scored[j].tolist(), strict=True))
            print(
                f"  example s={float(s[j]):.2f} src={float(src_mean[j]):.2f} rcv={float(rcv_mean[j]):.2f} "
                f"{problems[row // args.n].problem!r} -> {src_batch.texts[row]!r}\n    {pairs}"
            )
    summary = {
        "all_fail": {n: out["models"][n]["all_fail"] for n in names},
        "complementarity": {k: v["complementarity"] for k, v in out["directions"].items()},
        "candidates": {k: v["candidates"] for k, v in out["directions"].items()},
        "admit_all": {k: v["admit_all"] for k, v in out["directions"].items()},
        "admit_balanced": {k: v["admit_balanced"] for k, v in out["directions"].items()},
        "moved_wrong_classes": {k: v.get("moved_wrong_classes") for k, v in out["directions"].items()},
        "contrast_lesson": {k: v["contrast"].get("contrast_lesson") for k, v in out["directions"].items()},
    }
    out["summary"] = summary
    print("\nsummary " + json.dumps(summary))
    if args.graft_steps:
        out["graft_run"] = graft_run(paths, args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


def graft_run(paths: dict, args: argparse.Namespace) -> dict:
    """A short GRAFT run with the demo's settings: all-fail share, complementarity and the share
    of transferred responses the gate admits, per step and over the run (training prompts)."""
    import dataclasses
    import shutil

    from graftrl.config import config_from_dict
    from graftrl.embedded.base import demo_config, demo_settings, write_problems
    from graftrl.embedded.task import make_split
    from graftrl.models.rewards import MathVerifier
    from graftrl.storage.rundir import read_metrics
    from graftrl.training.trainer import Trainer

    settings = dataclasses.replace(demo_settings(args.task), steps=args.graft_steps)
    run_dir = Path(args.run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    train, _ = make_split(seed=0, n_train=settings.n_train, n_eval=settings.n_eval, task=args.task)
    write_problems(train, run_dir / "data" / "train.jsonl")
    raw = demo_config(paths, run_dir / "data" / "train.jsonl", "graft", args.seed, settings)
    raw["logging"]["progress"] = False
    start = time.perf_counter()
    with MathVerifier() as verifier:
        Trainer(config_from_dict(raw), run_dir / "run", verifier=verifier).train()
    rows = read_metrics(run_dir / "run")
    print(f"\nGRAFT {args.graft_steps} steps in {time.perf_counter() - start:.0f}s")
    per_model: dict = {}
    for row in rows:
        m = per_model.setdefault(row["model"], {"all_fail": [], "comp": [], "transferred": 0, "admitted": 0})
        m["all_fail"].append(row.get("all_fail_frac"))
        m["comp"] += [v for k, v in row.items() if k.startswith("complementarity/") and v is not None]
        m["transferred"] += row.get("peer_responses", 0) or 0
        m["admitted"] += row.get("peer_admitted", 0) or 0
        print(
            f"  step {row.get('step')} {row['model']:10s} all-fail {row.get('all_fail_frac', 0):.2f} "
            f"reward {row.get('reward_mean', float('nan')):.2f} "
            f"peer {row.get('peer_admitted', 0)}/{row.get('peer_responses', 0)}"
        )
    summary = {
        model: {
            "all_fail_mean": round(sum(m["all_fail"]) / len(m["all_fail"]), 3),
            "complementarity_mean": round(sum(m["comp"]) / len(m["comp"]), 3) if m["comp"] else None,
            "transferred": m["transferred"],
            "admitted_share": round(m["admitted"] / m["transferred"], 3) if m["transferred"] else None,
        }
        for model, m in per_model.items()
    }
    print("graft run summary " + json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
