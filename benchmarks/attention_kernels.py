"""Attention kernels (`policies[].attn_implementation`) side by side: rollout and update time.

One embedded model loaded once per kernel (``sdpa``, transformers' default, and ``eager`` unless
``--kernels`` says otherwise). Each repeat times, kernel after kernel so that load drifts hit all
alike: one rollout through graftrl's HF engine (the demo's 32 prompts x n = 8 at the worked task's
80 new tokens) and one update pass over those rows (the trainer's log-probs with gradients, then
backward). It reports each kernel's median times, their ratio to the first kernel's, and whether
its sampled token ids equal the first kernel's (they need not: kernels differ in their last bits).

    PYTHONPATH=src .venv/bin/python benchmarks/attention_kernels.py --threads 1 --repeats 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-char", help="embedded spec name (llama-char, gpt2-bpe)")
    ap.add_argument("--task", default="worked", help="embedded task of the prompts and models")
    ap.add_argument("--kernels", default="sdpa,eager", help="attn_implementation values, first = baseline")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    C.set_threads(args.threads)
    C.quiet_hf()
    from graftrl.embedded.task import make_split
    from graftrl.models.policy import Policy
    from graftrl.models.rollout import HFRolloutEngine, SamplingParams

    path = C.embedded_paths(args.cache_dir, args.task)[args.model]
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    policies = {
        k: Policy.from_pretrained(args.model, str(path), attn_implementation=k, template="{problem}=")
        for k in kernels
    }
    train, _ = make_split(seed=0, n_train=max(args.prompts, 1200), n_eval=256, task=args.task)
    problems = [p.problem for p in train[: args.prompts]]
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens)
    engine = HFRolloutEngine()
    times: dict[str, dict[str, list[float]]] = {k: {"rollout": [], "update": []} for k in kernels}
    same: dict[str, bool] = dict.fromkeys(kernels, True)
    for repeat in range(args.repeats + 1):  # the first round warms up, untimed
        sampled = {}
        for kernel, policy in policies.items():
            start = time.perf_counter()
            batch = engine.generate(policy, problems, params, seed=repeat)
            rollout = time.perf_counter() - start
            prompts = policy.encode_prompts(problems)
            rows = policy.pad(
                [prompts[i // args.n] for i in range(len(batch.response_ids))], batch.response_ids
            )
            start = time.perf_counter()
            policy.model.train()
            (policy.response_logprobs(rows) * rows.response_mask).sum().backward()
            policy.model.zero_grad(set_to_none=True)
            update = time.perf_counter() - start
            sampled[kernel] = batch.response_ids
            if repeat:
                times[kernel]["rollout"].append(rollout)
                times[kernel]["update"].append(update)
        same = {k: same[k] and sampled[k] == sampled[kernels[0]] for k in kernels}
    base = times[kernels[0]]
    results = {
        k: {
            "rollout_s": C.median(t["rollout"]),
            "update_s": C.median(t["update"]),
            "rollout_ratio": C.median(t["rollout"]) / C.median(base["rollout"]),
            "update_ratio": C.median(t["update"]) / C.median(base["update"]),
            "same_tokens_as_first": same[k],
        }
        for k, t in times.items()
    }
    note = C.contention_note(args.threads)
    if note:
        print(note)
    print(
        C.table(
            [
                "kernel",
                "rollout s",
                "update s",
                f"rollout / {kernels[0]}",
                f"update / {kernels[0]}",
                "same tokens",
            ],
            [
                [
                    k,
                    r["rollout_s"],
                    r["update_s"],
                    r["rollout_ratio"],
                    r["update_ratio"],
                    r["same_tokens_as_first"],
                ]
                for k, r in results.items()
            ],
            title=f"{args.model} ({args.task}), {args.prompts} x n={args.n}, {args.max_new_tokens} new tokens, "
            f"{args.threads} thread(s), median of {args.repeats}",
        )
    )
    payload = {"machine": C.machine_info(), "args": vars(args), "results": results}
    C.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
