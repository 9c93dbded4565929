"""TRL's GRPOTrainer vs graftrl's GRPO: median step time on the same tiny model, side by side.

One "step" is one rollout batch: P prompts x n samples, rewards, and the update over it
(P / minibatch_prompts optimizer steps). graftrl's Trainer logs one step per batch; TRL counts
optimizer steps, so a TRL step here is ``steps_per_generation / gradient_accumulation_steps``
consecutive optimizer steps (one generation cycle), timed with a callback.

Both sides get the same checkpoint (default: the embedded warm-started llama-char), the same
prompts in the same order (TRL's dataset is graftrl's prompt stream, step by step, unshuffled),
the same n, max new tokens, sampling (T = 1, top-p 1, top-k off), loss (DAPO token-mean,
clip 0.2 / 0.28, no KL), optimizer (AdamW lr / betas / weight decay / grad clip 1, constant lr),
minibatch layout (optimizer steps per batch, rows per forward pass), dtype, threads and the same
verifier (graftrl's math_verify worker pool; a fresh pool per framework so neither inherits the
other's answer cache). Nothing is logged, evaluated or saved during the timed steps.
See benchmarks/README.md for every setting that could not be matched.

Run it in an environment with TRL (``pip install -e '.[bench]'``):

    PYTHONPATH=src .venv-bench/bin/python benchmarks/trl_vs_graftrl.py --steps 10 --warmup 2
    ... --profile graftrl   # also profile one step of each framework with torch.profiler
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default="llama-char", help="embedded spec name (llama-char, gpt2-bpe) or a model folder"
    )
    ap.add_argument(
        "--template", default="{problem}=", help="prompt template (the embedded models' is '{problem}=')"
    )
    ap.add_argument("--steps", type=int, default=10, help="measured rollout batches per framework")
    ap.add_argument("--warmup", type=int, default=2, help="batches run first and left out")
    ap.add_argument("--batch-prompts", type=int, default=32)
    ap.add_argument("--minibatch-prompts", type=int, default=8, help="prompt groups per optimizer step")
    ap.add_argument(
        "--micro-batch-size", type=int, default=None, help="rows per forward/backward (default: a minibatch)"
    )
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="compute dtype (bf16: autocast, fp32 master weights, both sides)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--reward",
        default="math",
        choices=["math", "random"],
        help="math: graftrl's math_verify verifier on both sides; random: 0/1 coin flips on both sides "
        "(every group mixed, so neither side can skip zero-advantage rows: same training work; use it for "
        "random-init models, which never answer right)",
    )
    ap.add_argument("--order", default="graftrl,trl", help="which framework runs first")
    ap.add_argument(
        "--no-share-prompts",
        action="store_true",
        help="graftrl samples with plain generate (rollout.share_prompts: false), as before issue 25's shared prefill",
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="alternate the frameworks this many times (A B A B ...)"
    )
    ap.add_argument(
        "--profile",
        default="none",
        choices=["none", "graftrl", "trl", "both"],
        help="torch.profiler on one extra step",
    )
    ap.add_argument("--profile-rows", type=int, default=25)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def make_verifier(args):
    """A fresh verifier per framework run (a shared one would hand the second run a warm answer cache)."""
    if args.reward == "random":
        return C.CoinVerifier(args.seed)
    from graftrl.models.rewards import MathVerifier

    return MathVerifier()


def resolve_model(args) -> Path:
    if Path(args.model).is_dir():
        return Path(args.model)
    paths = C.embedded_paths(args.cache_dir)
    if args.model not in paths:
        raise SystemExit(f"--model {args.model!r}: not a folder nor one of {sorted(paths)}")
    return paths[args.model]


def layout(args) -> dict[str, int]:
    """Rows per forward (micro), forwards per optimizer step (GA), forwards per batch."""
    batch_rows = args.batch_prompts * args.n
    minibatch_rows = args.minibatch_prompts * args.n
    micro = args.micro_batch_size or minibatch_rows
    if batch_rows % minibatch_rows or minibatch_rows % micro:
        raise SystemExit("batch rows must be a multiple of minibatch rows, and those of --micro-batch-size")
    return {
        "batch_rows": batch_rows,
        "minibatch_rows": minibatch_rows,
        "micro": micro,
        "grad_accum": minibatch_rows // micro,
        "steps_per_generation": batch_rows // micro,
        "optimizer_steps_per_batch": batch_rows // minibatch_rows,
    }


def prompt_stream(args, total_steps: int):
    """graftrl's prompt batches for steps 0..total_steps-1 (TRL gets them in this order)."""
    from graftrl.embedded.task import make_split
    from graftrl.storage.data import MathProblem, PromptSampler

    train, _ = make_split(seed=0, n_train=1200, n_eval=256)
    problems = [MathProblem(p.id, p.problem, p.answer) for p in train]
    sampler = PromptSampler(problems, args.batch_prompts, args.seed)
    return problems, [sampler.batch(step) for step in range(total_steps)]


# ----------------------------------------------------------------------------------------------
def run_graftrl(
    args, model_path: Path, problems, lay: dict[str, int], work: Path, profile: bool
) -> dict[str, Any]:
    import torch

    from graftrl.config import config_from_dict
    from graftrl.storage.rundir import read_metrics
    from graftrl.training.trainer import Trainer

    total = args.warmup + args.steps + (1 if profile else 0)
    raw = {
        "seed": args.seed,
        "method": "grpo",
        "policies": [
            {
                "name": "policy",
                "path": str(model_path),
                "template": args.template,
                "dtype": args.dtype,
                "device": args.device,
            }
        ],
        "data": {"train": str(work / "unused.jsonl"), "prompt_suffix": None},
        "rollout": {
            "n": args.n,
            "temperature": 1.0,
            "top_p": 1.0,
            "max_new_tokens": args.max_new_tokens,
            "share_prompts": not args.no_share_prompts,
        },
        "optim": {"lr": args.lr, "weight_decay": args.weight_decay, "grad_clip": 1.0, "betas": [0.9, 0.999]},
        "train": {
            "steps": total,
            "batch_prompts": args.batch_prompts,
            "minibatch_prompts": args.minibatch_prompts,
            "micro_batch_size": lay["micro"],
            "eps_low": 0.2,
            "eps_high": 0.28,
            "kl_coef": 0.0,
            "update_epochs": 1,
        },
        "logging": {"progress": False, "log_samples": 0},
        "checkpoint": {"every": 0, "keep_last": 1},
    }
    config = config_from_dict(raw)
    marks: list[float] = []
    prof_holder: dict[str, Any] = {}

    def callback(step: int, metrics) -> None:
        marks.append(time.perf_counter())
        if profile and step == total - 2:  # profile the last step, outside the figures
            import torch.profiler as tp

            prof_holder["p"] = tp.profile(activities=[tp.ProfilerActivity.CPU])
            prof_holder["p"].__enter__()
        elif "p" in prof_holder and step == total - 1:
            prof_holder["p"].__exit__(None, None, None)

    run_dir = work / "graftrl"
    torch.manual_seed(args.seed)
    with make_verifier(args) as verifier:
        trainer = Trainer(config, run_dir, problems=problems, verifier=verifier, step_callback=callback)
        threads = torch.get_num_threads()
        start = time.perf_counter()
        trainer.train()
    profile_text = None
    if "p" in prof_holder:
        profile_text = (
            f"\n--- torch.profiler: one graftrl GRPO step, top {args.profile_rows} ops by self time ---\n"
            + prof_holder["p"]
            .key_averages()
            .table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)
        )
    walls = [b - a for a, b in zip([start, *marks[:-1]], marks, strict=True)]
    rows = read_metrics(run_dir)[: args.warmup + args.steps]
    phases = {
        key: [r.get(key) for r in rows[args.warmup :]]
        for key in (
            "time_rollout",
            "time_reward",
            "time_old_logprob",
            "time_update",
            "time_weight_sync",
            "time_step",
        )
    }
    return {
        "step_s": walls[args.warmup : args.warmup + args.steps],
        "phases": phases,
        "response_length": [r.get("response_length") for r in rows[args.warmup :]],
        "train_tokens": [r.get("train_tokens") for r in rows[args.warmup :]],
        "threads": threads,
        "profile": profile_text,
    }


# ----------------------------------------------------------------------------------------------
def run_trl(
    args, model_path: Path, batches, lay: dict[str, int], work: Path, profile: bool
) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    total = args.warmup + args.steps + (1 if profile else 0)
    per_batch = lay["optimizer_steps_per_batch"]
    # graftrl's prompt stream, batch by batch; TRL's sampler takes them in order (shuffle off).
    rows = [
        {"prompt": args.template.format(problem=p.problem), "answer": p.answer}
        for batch in batches[:total]
        for p in batch
    ]
    dataset = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    bf16 = args.dtype == "bfloat16"
    config = GRPOConfig(
        output_dir=str(work / "trl"),
        # layout: one generation of batch_rows rows, split into micro-batches of `micro` rows;
        # grad_accum micro-batches per optimizer step -> optimizer_steps_per_batch steps per batch
        per_device_train_batch_size=lay["micro"],
        gradient_accumulation_steps=lay["grad_accum"],
        steps_per_generation=lay["steps_per_generation"],
        num_generations=args.n,
        num_iterations=1,
        max_completion_length=args.max_new_tokens,
        shuffle_dataset=False,
        # sampling
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        repetition_penalty=1.0,
        use_vllm=False,
        # loss
        loss_type="dapo",
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        scale_rewards="group",
        mask_truncated_completions=False,
        importance_sampling_level="token",
        # optimizer
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=args.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        optim="adamw_torch",
        # precision / device
        bf16=bf16,
        fp16=False,
        use_cpu=args.device == "cpu",
        **_no_checkpointing(GRPOConfig),
        disable_dropout=True,
        # no logging / eval / saving overhead
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
        max_steps=total * per_batch,
        seed=args.seed,
        remove_unused_columns=False,
    )
    verifier = make_verifier(args)

    def reward(completions, answer, **kwargs):
        return verifier.score(list(completions), list(answer))

    marks: list[float] = []

    class Timer(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, a, state, control, **k):
            if state.global_step % per_batch == 0:
                marks.append(time.perf_counter())

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    spans: dict[str, list[float]] = {
        "sampling": [],
        "generate": [],
        "reward": [],
        "old_logprob": [],
        "generate_and_score": [],
    }
    # sampling = prompts tokenized, generated, completions decoded: the scope of graftrl's rollout
    # phase (its engine encodes and decodes too); generate = the model's generate call alone
    _time_method(trainer, "_generate", spans["sampling"])
    _time_method(trainer, "_generate_single_turn", spans["generate"])
    _time_method(trainer, "_calculate_rewards", spans["reward"])
    _time_method(trainer, "_generate_and_score_completions", spans["generate_and_score"])
    original = trainer._get_per_token_logps_and_entropies

    def logps(*a, **k):
        if torch.is_grad_enabled():
            return original(*a, **k)
        start = time.perf_counter()
        out = original(*a, **k)
        spans["old_logprob"].append(time.perf_counter() - start)
        return out

    trainer._get_per_token_logps_and_entropies = logps
    threads = torch.get_num_threads()
    profile_text = None
    if profile:
        # Profile the last batch: stop the timer at `total - 1` batches, then profile the rest.
        import torch.profiler as tp

        prof_holder: dict[str, Any] = {}

        class Prof(TrainerCallback):
            def on_step_end(self, a, state, control, **k):
                if state.global_step == (total - 1) * per_batch:
                    prof_holder["p"] = tp.profile(activities=[tp.ProfilerActivity.CPU])
                    prof_holder["p"].__enter__()

            def on_train_end(self, *a, **k):
                if "p" in prof_holder:
                    prof_holder["p"].__exit__(None, None, None)

        trainer.add_callback(Prof())
    try:
        trainer.train()
    finally:
        verifier.close()
    if profile and "p" in prof_holder:
        profile_text = (
            f"\n--- torch.profiler: one TRL GRPO step ({per_batch} optimizer steps), top {args.profile_rows} ops "
            "by self time ---\n"
            + prof_holder["p"]
            .key_averages()
            .table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)
        )
    walls = [b - a for a, b in itertools.pairwise(marks)]
    measured = slice(args.warmup, args.warmup + args.steps)
    gen_score = spans["generate_and_score"][measured]
    return {
        "step_s": walls[measured],
        "phases": {
            "sampling": spans["sampling"][measured],
            "generate": spans["generate"][measured],
            "reward": spans["reward"][measured],
            "old_logprob": spans["old_logprob"][measured],
            "generate_and_score": gen_score,
            "train": [w - g for w, g in zip(walls[measured], gen_score, strict=True)],
        },
        "threads": threads,
        "profile": profile_text,
    }


def _no_checkpointing(config_class) -> dict[str, bool]:
    """Activation checkpointing off (TRL's default is on); transformers 5 renamed the argument."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_class)}
    return (
        {"activation_checkpointing": False}
        if "activation_checkpointing" in names
        else {"gradient_checkpointing": False}
    )


def _time_method(obj, name: str, sink: list[float]) -> None:
    original = getattr(obj, name)

    def timed(*a, **k):
        start = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            sink.append(time.perf_counter() - start)

    setattr(obj, name, timed)


# ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    C.set_threads(args.threads)
    C.quiet_hf()
    from graftrl.machine import tune_allocator

    # One process, one malloc setting for both frameworks: graftrl's commands' (``tune_allocator``),
    # or glibc's default under GRAFTRL_MALLOC=default (run `--order trl` so for TRL as shipped).
    allocator = "graftrl's" if tune_allocator() else "glibc's default"
    note = C.contention_note(args.threads)
    info = C.machine_info()
    info["malloc"] = allocator
    import trl

    info["trl"] = trl.__version__
    model_path = resolve_model(args)
    lay = layout(args)
    total = args.warmup + args.steps + 1
    problems, batches = prompt_stream(args, total)
    order = [x.strip() for x in args.order.split(",")]
    results: dict[str, list[dict[str, Any]]] = {"graftrl": [], "trl": []}
    with tempfile.TemporaryDirectory(prefix="graftrl-trl-bench-") as tmp:
        for repeat in range(args.repeats):
            for framework in order:
                work = Path(tmp) / f"{framework}-{repeat}"
                profile = args.profile in (framework, "both") and repeat == args.repeats - 1
                start = time.perf_counter()
                if framework == "graftrl":
                    result = run_graftrl(args, model_path, problems, lay, work, profile)
                else:
                    result = run_trl(args, model_path, batches, lay, work, profile)
                print(f"{framework} (repeat {repeat}): {time.perf_counter() - start:.1f}s", flush=True)
                results[framework].append(result)

    def pooled(framework: str, key: str, phase: str | None = None) -> list[float]:
        out: list[float] = []
        for r in results[framework]:
            values = r[key] if phase is None else r["phases"].get(phase, [])
            out += [v for v in values if v is not None]
        return out

    g_step, t_step = C.median(pooled("graftrl", "step_s")), C.median(pooled("trl", "step_s"))
    summary = {
        "layout": lay,
        "graftrl": {
            "step_median_s": g_step,
            "rollout_s": C.median(pooled("graftrl", "phases", "time_rollout")),
            "reward_s": C.median(pooled("graftrl", "phases", "time_reward")),
            "update_s": C.median(pooled("graftrl", "phases", "time_update")),
            "response_length": C.mean(pooled("graftrl", "response_length")),
            "threads": results["graftrl"][0]["threads"] if results["graftrl"] else None,
        },
        "trl": {
            "step_median_s": t_step,
            "sampling_s": C.median(pooled("trl", "phases", "sampling")),
            "generate_s": C.median(pooled("trl", "phases", "generate")),
            "reward_s": C.median(pooled("trl", "phases", "reward")),
            "old_logprob_s": C.median(pooled("trl", "phases", "old_logprob")),
            "train_s": C.median(pooled("trl", "phases", "train")),
            "threads": results["trl"][0]["threads"] if results["trl"] else None,
        },
        "ratio_graftrl_over_trl": (g_step / t_step) if (g_step and t_step) else None,
    }
    if note:
        print(note)
    g, t = summary["graftrl"], summary["trl"]
    print(
        C.table(
            [
                "framework",
                "step s (median)",
                "sampling s",
                "reward s",
                "old log-prob s",
                "update s",
                "threads",
            ],
            [
                [
                    "graftrl GRPO",
                    g["step_median_s"],
                    g["rollout_s"],
                    g["reward_s"],
                    0.0,
                    g["update_s"],
                    g["threads"],
                ],
                [
                    "TRL GRPOTrainer",
                    t["step_median_s"],
                    t["sampling_s"],
                    t["reward_s"],
                    t["old_logprob_s"],
                    t["train_s"],
                    t["threads"],
                ],
            ],
            title=(
                f"One rollout batch = {args.batch_prompts} prompts x n={args.n}, max_new_tokens={args.max_new_tokens}, "
                f"{lay['optimizer_steps_per_batch']} optimizer steps of {lay['minibatch_rows']} rows, "
                f"{lay['micro']} rows per forward; model {model_path.name}; {args.dtype} on {args.device}; "
                f"reward {args.reward}; malloc settings {allocator}; "
                f"medians over {args.steps} batches x {args.repeats} repeat(s) after {args.warmup} warm-up"
            ),
        )
    )
    print(f"graftrl / TRL step-time ratio: {C.fmt(summary['ratio_graftrl_over_trl'])}  (TRL {info['trl']})")
    if g["rollout_s"] and t["sampling_s"]:
        summary["sampling_ratio_graftrl_over_trl"] = g["rollout_s"] / t["sampling_s"]
        print(
            f"graftrl / TRL sampling ratio: {C.fmt(summary['sampling_ratio_graftrl_over_trl'])} (both: prompts "
            f"tokenized, generated, completions decoded; TRL's generate call alone: {C.fmt(t['generate_s'])} s)"
        )
    print(
        "TRL's update column is the rest of its step (optimizer steps, loss, metrics bookkeeping); graftrl has "
        "no old log-prob pass (it keeps the sampler's log-probs) and skips zero-advantage rows in the update."
    )
    for framework in ("graftrl", "trl"):
        for r in results[framework]:
            if r.get("profile"):
                print(r["profile"])
    payload = {"args": vars(args), "machine": info, "contention": note, "summary": summary, "raw": results}
    C.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
