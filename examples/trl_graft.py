"""GRAFT from TRL: record a GPT-2 GRPO run with TRL, then train the Llama with GRAFT from it.

On graftrl's embedded task (``worked``: two ~1M-parameter models warm-started on complementary
regrouping skills, cached in ~/.cache/graftrl/embedded, built on first use in ~3 minutes), on CPU:

    bash scripts/setup_trl.sh
    .venv-trl/bin/python examples/trl_graft.py                   # record + replay, one seed
    .venv-trl/bin/python examples/trl_graft.py --baseline --seeds 0 1 2   # the measurement

1. **Record**: TRL's GRPOTrainer on the GPT-2, as ``RecordingGRPOTrainer``, writes every
   generation batch (32 prompts x 8 samples) into a graftrl trajectory store.
2. **Replay**: ``GraftGRPOTrainer`` trains the Llama on the same prompt stream (same seed, so TRL
   draws the same prompts at each step); where the Llama fails all 8 samples of a prompt and the
   stored GPT-2 group is mixed, the GPT-2's group, re-tokenized and weighted by its compatibility,
   replaces the Llama's. The GPT-2 is never loaded.

With ``--baseline`` the Llama is also trained by plain ``GRPOTrainer`` from the same warm-start and
seed, both Llamas are evaluated on the held-out problems with the paper's protocol (8 samples at
T = 0.6, top-p 0.95; ``graftrl.evaluation``), and the paired difference over the seeds is printed
with its 95% interval over seeds (``graftrl.evaluation.intervals.seed_interval``). Settings are the demo's
(``graftrl.experiments.compare.task.demo_settings``): 32 prompts x n = 8 per step, 4 optimizer steps per
step, AdamW lr 1e-4, DAPO loss, clip 0.2 / 0.28, 80 new tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

SPECS = {"peer": "gpt2-bpe", "receiver": "llama-char"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--steps", type=int, default=None, help="RL steps (generation batches); default the demo's 60"
    )
    parser.add_argument(
        "--baseline", action="store_true", help="also train TRL GRPO and evaluate both (paired table)"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/trl_graft"))
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "graftrl" / "embedded")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    return parser.parse_args()


def trl_config(out: Path, seed: int, settings: Any, steps: int, **graft: Any):
    """The demo's settings as a TRL config: one generation batch = one graftrl step."""
    from graftrl.integrations.trl import GraftGRPOConfig

    rows_per_optimizer_step = settings.minibatch_prompts * settings.n
    return GraftGRPOConfig(
        output_dir=str(out),
        seed=seed,
        num_generations=settings.n,
        per_device_train_batch_size=rows_per_optimizer_step,
        gradient_accumulation_steps=1,
        steps_per_generation=settings.batch_prompts // settings.minibatch_prompts,
        max_steps=steps * settings.batch_prompts // settings.minibatch_prompts,
        max_completion_length=settings.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=settings.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        max_grad_norm=1.0,
        optim="adamw_torch",
        loss_type="dapo",
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        scale_rewards="group",
        bf16=False,
        use_cpu=True,
        activation_checkpointing=False,
        disable_dropout=True,
        report_to="none",
        save_strategy="no",
        logging_steps=settings.batch_prompts // settings.minibatch_prompts,  # once per generation batch
        disable_tqdm=True,
        **{f"graft_{key}": value for key, value in graft.items()},
    )


def train(kind: str, path: Path, dataset: Any, reward: Any, args: Any, **extra: Any) -> tuple[Any, float]:
    """One TRL run (kind: record / grpo / graft) from the warm-started model at ``path``; CPU-seconds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from graftrl.integrations.trl import GraftGRPOTrainer, RecordingGRPOTrainer

    trainer_class = {"record": RecordingGRPOTrainer, "grpo": GRPOTrainer, "graft": GraftGRPOTrainer}[kind]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = trainer_class(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        **extra,
    )
    start = cpu_seconds()
    trainer.train()
    return trainer, cpu_seconds() - start


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def exchange_summary(trainer: Any) -> dict[str, float]:
    """Per-step means of GraftGRPOTrainer's exchange metrics (TRL's log history)."""
    rows = [h for h in trainer.state.log_history if any(k.startswith("graft/") for k in h)]
    keys = (
        "graft/selected/peer",
        "graft/peer_responses",
        "graft/peer_admitted",
        "graft/s_median",
        "graft/w_mean",
    )
    return {key: statistics.fmean(r.get(key, 0.0) for r in rows) for key in keys if rows}


def evaluate(
    model: Any, tokenizer: Any, heldout: list[Any], verifier: Any, settings: Any, seed: int
) -> dict[str, Any]:
    """Held-out pass@1 of the Llama with the paper's protocol (the demo's evaluation: seed 10000 + seed)."""
    from graftrl.embedded.models import MODEL_SPECS
    from graftrl.evaluation.evaluate import EvalProtocol, evaluate_pass_at_1
    from graftrl.models.policy import Policy

    policy = Policy(SPECS["receiver"], model, tokenizer, template=MODEL_SPECS[SPECS["receiver"]]["template"])
    protocol = EvalProtocol(samples=settings.eval_samples, max_new_tokens=settings.max_new_tokens)
    result = evaluate_pass_at_1(policy, heldout, verifier, protocol, seed=10_000 + seed)
    return {"pass_at_1": result["pass_at_1"], "per_family": result.get("per_family", {})}


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset

    from graftrl.embedded.models import MODEL_SPECS
    from graftrl.embedded.task import make_split
    from graftrl.embedded.warmstart import prepare_embedded_models
    from graftrl.experiments.compare.task import demo_settings
    from graftrl.integrations.trl import StoredPeer, math_reward
    from graftrl.models.rewards import MathVerifier
    from graftrl.storage.data import MathProblem

    settings = demo_settings("worked")
    steps = args.steps or settings.steps
    paths = prepare_embedded_models(args.cache_dir, task="worked")
    train_problems, heldout_problems = make_split(
        seed=0, n_train=settings.n_train, n_eval=settings.n_eval, task="worked"
    )
    heldout = [MathProblem(p.id, p.problem, p.answer, p.family) for p in heldout_problems]
    template = MODEL_SPECS[SPECS["receiver"]]["template"]
    assert template == MODEL_SPECS[SPECS["peer"]]["template"]  # one dataset serves both models
    dataset = Dataset.from_list(
        [
            {"prompt": template.format(problem=p.problem), "prompt_id": p.id, "answer": p.answer}
            for p in train_problems
        ]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"settings": {"steps": steps, **vars(settings)}, "seeds": {}}
    reward = math_reward  # the 0/1 reward graftrl train gives (the dataset's `answer` column)
    with MathVerifier() as verifier:  # the held-out evaluation's
        if args.baseline:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            path = paths[SPECS["receiver"]]
            warm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            results["warm_start"] = evaluate(
                warm, AutoTokenizer.from_pretrained(path), heldout, verifier, settings, 0
            )
        for seed in args.seeds:
            run = args.out / f"seed{seed}"
            store = run / "store"  # the recorded GPT-2 run (git-ignored under experiments/)
            started = time.perf_counter()
            _, cpu_record = train(
                "record",
                paths[SPECS["peer"]],
                dataset,
                reward,
                trl_config(run / "record", seed, settings, steps),
                record_store=store,
                record_source="peer",
            )
            print(
                f"seed {seed}: recorded {steps} GPT-2 GRPO steps into {store} ({cpu_record:.0f} CPU-s)",
                flush=True,
            )
            graft, cpu_graft = train(
                "graft",
                paths[SPECS["receiver"]],
                dataset,
                reward,
                trl_config(run / "graft", seed, settings, steps),
                peers=[StoredPeer(store, "peer")],
            )
            row: dict[str, Any] = {
                "exchange": exchange_summary(graft),
                "cpu_s": {"record": cpu_record, "graft": cpu_graft},
            }
            print(
                f"seed {seed}: GraftGRPOTrainer on the Llama ({cpu_graft:.0f} CPU-s), per step: {row['exchange']}",
                flush=True,
            )
            if args.baseline:
                grpo, cpu_grpo = train(
                    "grpo",
                    paths[SPECS["receiver"]],
                    dataset,
                    reward,
                    trl_config(run / "grpo", seed, settings, steps),
                )
                row["cpu_s"]["grpo"] = cpu_grpo
                row["graft"] = evaluate(
                    graft.model, graft.processing_class, heldout, verifier, settings, seed
                )
                row["grpo"] = evaluate(grpo.model, grpo.processing_class, heldout, verifier, settings, seed)
                print(
                    f"seed {seed}: held-out pass@1 TRL GRPO {row['grpo']['pass_at_1']:.3f}, "
                    f"GraftGRPOTrainer {row['graft']['pass_at_1']:.3f} ({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
            results["seeds"][seed] = row
    if args.baseline:
        results["table"] = table(results)
        print(results["table"])
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {args.out / 'results.json'}")


def table(results: dict[str, Any]) -> str:
    """Markdown: held-out pass@1 (%) of the Llama, overall and per family, with the paired interval."""
    from graftrl.evaluation.intervals import seed_interval
    from graftrl.evaluation.stats import mean_std

    seeds = results["seeds"]
    families = ["overall", *sorted(next(iter(seeds.values()))["grpo"]["per_family"])]

    def score(entry: dict[str, Any], family: str) -> float:
        return 100 * (entry["pass_at_1"] if family == "overall" else entry["per_family"][family])

    lines = [
        "| llama-char · family | warm-start | TRL GRPO | GraftGRPOTrainer (stored GPT-2) | paired GRAFT − GRPO [95% CI] |",
        "|---|---|---|---|---|",
    ]
    for family in families:
        grpo = {s: score(r["grpo"], family) for s, r in seeds.items()}
        graft = {s: score(r["graft"], family) for s, r in seeds.items()}
        diff = seed_interval(graft, grpo)
        assert diff is not None
        lines.append(
            f"| {family} | {score(results['warm_start'], family):.1f} | {mean_std(list(grpo.values())).format(digits=1)} | "
            f"{mean_std(list(graft.values())).format(digits=1)} | {diff.format(scale=1, digits=1)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
