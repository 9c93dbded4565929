"""`graftrl demo`: the embedded default — GRPO vs GRAFT on two tiny heterogeneous models, offline.

Pipeline: warm-start a char-level Llama and a BPE GPT-2 on complementary skills (cached), then for
each seed train GRPO (n = 8) and GRAFT on the same prompts, steps and per-model rollout budget,
evaluate held-out pass@1 with the paper's sampling protocol, and write a table, plots and
``results.json``.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from graftrl.config import config_from_dict
from graftrl.embedded.models import MODEL_SPECS
from graftrl.embedded.task import DEFAULT_TASK, get_task, make_split
from graftrl.embedded.warmstart import prepare_embedded_models
from graftrl.evaluation.evaluate import EvalProtocol, evaluate_pass_at_1
from graftrl.models.policy import Policy
from graftrl.models.rewards import MathVerifier
from graftrl.reporting.plots import (
    plot_compatibility_histogram,
    plot_complementarity,
    plot_family_curves,
    plot_pass_at_1,
    plot_training_curves,
    read_compatibility,
)
from graftrl.reporting.stats import PairedDifference, family_rows, mean_std, paired_difference
from graftrl.storage.data import load_problems
from graftrl.storage.rundir import ExperimentDir, read_metrics
from graftrl.training.trainer import Trainer


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of the embedded comparison. The RL settings are the paper's except where noted."""

    task: str = DEFAULT_TASK
    """Embedded task by name (``graftrl.embedded.task.TASKS``): its problems, format and models."""
    steps: int = 60
    """RL steps per method."""
    batch_prompts: int = 32
    """Prompts per step (paper: 128; scaled to the CPU)."""
    minibatch_prompts: int = 8
    """Prompt groups per optimizer step: 4 optimizer steps per batch, as the paper's 128/32."""
    n: int = 8
    """Rollouts per prompt per model (the paper's n = 8)."""
    lr: float = 1e-4
    """Tiny randomly initialised models need a far larger rate than the paper's 1e-6."""
    max_new_tokens: int | None = None
    """Response length limit; None: the task's (``EmbeddedTask.max_new_tokens``)."""
    n_train: int = 1200
    """Procedural RL training problems."""
    n_eval: int = 256
    """Held-out problems, disjoint from training."""
    eval_samples: int = 8
    """Samples per held-out problem (paper protocol: 8 at T = 0.6, top-p 0.95)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens is None:
            object.__setattr__(self, "max_new_tokens", get_task(self.task).max_new_tokens)


DEFAULT = DemoSettings()
QUICK = DemoSettings(steps=4, batch_prompts=16, minibatch_prompts=4, n_train=200, n_eval=48, eval_samples=4)
METHODS = ("grpo", "graft")


def demo_settings(task: str = DEFAULT_TASK, quick: bool = False) -> DemoSettings:
    """The demo's sizes (``quick``: smoke-test sizes) on the embedded task ``task``."""
    return replace(QUICK if quick else DEFAULT, task=task, max_new_tokens=get_task(task).max_new_tokens)


def demo_config(
    paths: dict[str, Path], train_file: Path, method: str, seed: int, settings: DemoSettings
) -> dict[str, Any]:
    return {
        "seed": seed,
        "method": method,
        "policies": [
            {"name": name, "path": str(path), "template": MODEL_SPECS[name]["template"]}
            for name, path in paths.items()
        ],
        "data": {"train": str(train_file), "prompt_suffix": None},
        "rollout": {"n": settings.n, "temperature": 1.0, "max_new_tokens": settings.max_new_tokens},
        "optim": {"lr": settings.lr},
        "train": {
            "steps": settings.steps,
            "batch_prompts": settings.batch_prompts,
            "minibatch_prompts": settings.minibatch_prompts,
            "micro_batch_size": 128,
        },
        "logging": {"progress": True, "log_samples": 1},
    }


def _write_jsonl(problems, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer, "family": p.family}) + "\n"
            for p in problems
        )
    )


def _evaluate(policies, heldout, verifier, settings: DemoSettings, seed: int) -> dict[str, dict[str, Any]]:
    """policy -> {"pass_at_1", "per_family"} on the held-out problems (paper protocol)."""
    protocol = EvalProtocol(samples=settings.eval_samples, max_new_tokens=settings.max_new_tokens)
    out = {}
    for policy in policies:
        result = evaluate_pass_at_1(policy, heldout, verifier, protocol, seed=10_000 + seed)
        out[policy.name] = {
            "pass_at_1": float(result["pass_at_1"]),
            "per_family": result.get("per_family", {}),
        }
    return out


def run_demo(
    out_dir: Path,
    quick: bool = False,
    seeds: int = 1,
    cache_dir: Path | None = None,
    console: Console | None = None,
    task: str = DEFAULT_TASK,
) -> dict[str, Any]:
    console = console or Console()
    settings = demo_settings(task, quick)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = cache_dir or Path.home() / ".cache" / "graftrl" / "embedded"
    started = time.perf_counter()
    console.print(f"[bold]warm-starting the embedded models[/bold] for task {task!r} (cached in {cache_dir})")
    paths = prepare_embedded_models(cache_dir, quick=quick, seed=0, task=task)
    console.print(
        f"models ready in {time.perf_counter() - started:.0f}s: "
        + ", ".join(f"{k} -> {v}" for k, v in paths.items())
    )

    train, heldout = make_split(seed=0, n_train=settings.n_train, n_eval=settings.n_eval, task=task)
    out = ExperimentDir(out_dir)
    _write_jsonl(train, out.train_data)
    _write_jsonl(heldout, out.heldout_data)
    heldout_problems = load_problems(out.heldout_data)

    rows: list[dict[str, Any]] = []
    curves: dict[str, list[dict[str, Any]]] = {}
    with MathVerifier() as verifier:
        initial = [
            Policy.from_pretrained(name, str(path), template=MODEL_SPECS[name]["template"])
            for name, path in paths.items()
        ]
        for model, score in _evaluate(initial, heldout_problems, verifier, settings, seed=0).items():
            rows.append(
                {
                    "method": "warm-start",
                    "model": model,
                    "seed": 0,
                    "n": settings.n,
                    **score,
                    "steps": 0,
                    "wall_s": 0.0,
                }
            )
        for seed in range(seeds):
            for method in METHODS:
                run_dir = out.run(method, seed).root
                if run_dir.exists():
                    import shutil

                    shutil.rmtree(run_dir)
                config = config_from_dict(
                    demo_config(paths, out.train_data, method, seed, settings)
                )
                console.print(f"[bold]{method}[/bold] seed {seed}: {settings.steps} steps")
                start = time.perf_counter()
                trainer = Trainer(config, run_dir, verifier=verifier)
                trainer.train()
                wall = time.perf_counter() - start
                scores = _evaluate(trainer.policies, heldout_problems, verifier, settings, seed)
                for model, score in scores.items():
                    rows.append(
                        {
                            "method": method,
                            "model": model,
                            "seed": seed,
                            "n": settings.n,
                            **score,
                            "steps": settings.steps,
                            "wall_s": round(wall, 2),
                        }
                    )
                curves[f"{method} seed {seed}"] = read_metrics(run_dir)

    diagnostics = summarize_exchange(curves)
    results = {
        "rows": rows,
        "settings": asdict(settings),
        "diagnostics": diagnostics,
        "paired_vs_grpo": {
            method: {model: diff.as_dict() for model, diff in models.items()}
            for method, models in paired_vs_grpo(rows + family_rows(rows)).items()
        },
        "total_wall_s": round(time.perf_counter() - started, 1),
    }
    out.results.write_text(json.dumps(results, indent=2))
    plot_training_curves(curves, out_dir / "training_curves.png")
    plot_complementarity({k: v for k, v in curves.items()}, out_dir / "complementarity.png")
    scores: dict[str, list[float]] = {}
    for seed in range(seeds):
        for receiver, values in read_compatibility(out.run("graft", seed).root).items():
            scores.setdefault(receiver, []).extend(values)
    plot_compatibility_histogram(scores, out_dir / "compatibility_hist.png")
    plot_pass_at_1(rows, out_dir / "pass_at_1.png")
    plot_family_curves(curves, out_dir / "family_curves.png")
    console.print(results_table(rows))
    if by_family := family_rows(rows):
        console.print(results_table(by_family, title="held-out pass@1 per problem family"))
    console.print(diagnostics_table(diagnostics))
    console.print(f"wrote {out_dir}/results.json and plots in {time.perf_counter() - started:.0f}s")
    return results


def summarize_exchange(curves: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Mean per-step all-fail share and complementarity (all runs) and GRAFT's exchange volumes,
    per model: the regime statistics of docs/task_design.md."""
    out: dict[str, Any] = {}
    for label, rows in curves.items():
        method = label.split()[0]
        for row in rows:
            entry = out.setdefault(method, {}).setdefault(
                row["model"],
                {"all_fail": [], "complementarity": [], "selected": [], "peer_responses": [], "admitted": []},
            )
            if row.get("all_fail_frac") is not None:
                entry["all_fail"].append(row["all_fail_frac"])
            entry["complementarity"] += [
                v for k, v in row.items() if k.startswith("complementarity/") and v is not None
            ]
            entry["selected"] += [v for k, v in row.items() if k.startswith("selected/")]
            entry["peer_responses"].append(row.get("peer_responses", 0))
            entry["admitted"].append(row.get("peer_admitted", 0))
    summary: dict[str, Any] = {}
    for method, models in out.items():
        for model, entry in models.items():
            transferred = sum(entry["peer_responses"])
            summary.setdefault(method, {})[model] = {
                "all_fail_mean": statistics.fmean(entry["all_fail"]) if entry["all_fail"] else None,
                "complementarity_mean": statistics.fmean(entry["complementarity"])
                if entry["complementarity"]
                else None,
                "selected_prompts_per_step": statistics.fmean(entry["selected"])
                if entry["selected"]
                else 0.0,
                "transferred_responses": transferred,
                "admitted_responses": sum(entry["admitted"]),
                "admit_rate": sum(entry["admitted"]) / transferred if transferred else None,
            }
    return summary


def paired_vs_grpo(rows: list[dict[str, Any]]) -> dict[str, dict[str, PairedDifference]]:
    """method -> model -> held-out pass@1 minus GRPO's, paired by seed, with its 95% interval."""
    by_key: dict[tuple[str, str], dict[int, float]] = {}
    for row in rows:
        by_key.setdefault((row["model"], row["method"]), {})[int(row["seed"])] = row["pass_at_1"]
    out: dict[str, dict[str, PairedDifference]] = {}
    for (model, method), by_seed in by_key.items():
        grpo = by_key.get((model, "grpo"))
        if method not in ("grpo", "warm-start") and grpo and (diff := paired_difference(by_seed, grpo)):
            out.setdefault(method, {})[model] = diff
    return out


def results_table(rows: list[dict[str, Any]], title: str = "graftrl demo") -> Table:
    table = Table(
        "model",
        "method",
        "held-out pass@1 (mean ± std over seeds)",
        "seeds",
        "paired Δ vs GRPO [95% CI]",
        title=title,
        caption="* = the interval excludes 0 (a difference the seeds resolve)",
    )
    by_key: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        by_key.setdefault((row["model"], row["method"]), []).append(row["pass_at_1"])
    paired = paired_vs_grpo(rows)
    for (model, method), values in sorted(by_key.items()):
        diff = paired.get(method, {}).get(model)
        table.add_row(
            model, method, mean_std(values).format(), str(len(values)), diff.format() if diff else ""
        )
    return table


def diagnostics_table(diagnostics: dict[str, Any]) -> Table:
    table = Table(
        "method",
        "receiver",
        "all-fail share",
        "complementarity",
        "selected prompts/step",
        "transferred",
        "admitted (s > δ)",
        title="exchange diagnostics (mean over steps and seeds)",
    )
    for method, models in diagnostics.items():
        for model, d in models.items():
            comp = d["complementarity_mean"]
            rate = d["admit_rate"]
            all_fail = d.get("all_fail_mean")
            table.add_row(
                method,
                model,
                "" if all_fail is None else f"{all_fail:.3f}",
                "" if comp is None else f"{comp:.3f}",
                f"{d['selected_prompts_per_step']:.2f}",
                str(d["transferred_responses"]),
                f"{d['admitted_responses']}" + ("" if rate is None else f" ({rate:.0%})"),
            )
    return table
