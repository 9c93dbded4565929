"""The commands on one run: ``train``, ``probe``, ``eval``, ``import-trajectories`` and ``analyze``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from graftrl.cli.common import app, console, out_folder, thread_note
from graftrl.storage.rundir import ensure_writable


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="YAML config file.")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a field: --set train.steps=10")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(callback=out_folder, help="Run directory (default runs/<config stem>).")
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            help="Continue from the newest intact checkpoint in the run directory (step 0 when it has none)."
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            help="With --resume: continue even though the config changes the run's seed, method, "
            "rollout.n, policies or data."
        ),
    ] = False,
) -> None:
    """Train the configured policies with GRPO or GRAFT."""
    from graftrl.config import ConfigError, load_config, minibatch_note
    from graftrl.storage.checkpoint import hold_run_lock
    from graftrl.storage.rundir import RunDir

    cfg = load_config(config, set_ or [])
    run_dir = out_folder(out or Path("runs") / config.stem)
    assert run_dir is not None
    # The lock first: a second process on this folder is refused before it reads anything.
    with hold_run_lock(run_dir):
        if RunDir(run_dir).holds_run() and not resume:
            raise ConfigError(
                f"{run_dir} already holds a run; pass --resume to continue it (from step 0 when it has "
                "no checkpoint yet) or --out for a new folder"
            )
        if note := minibatch_note(cfg):
            console.print(f"[yellow]note:[/yellow] {escape(note)}", soft_wrap=True)
        from graftrl.training.trainer import Trainer

        try:
            trainer = Trainer(cfg, run_dir)
        except FileNotFoundError as error:  # a model or data path
            raise ConfigError(str(error)) from None
        trainer.train(resume=resume, force=force, on_checked=thread_note)
    console.print(f"run written to {run_dir}")


@app.command()
def probe(
    config: Annotated[Path, typer.Argument(help="YAML config file (the one you would train).")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a field: --set graft.delta=0.7")
    ] = None,
    prompts: Annotated[
        int, typer.Option(help="Training prompts to probe (the first ones training would draw).")
    ] = 256,
    out: Annotated[
        Path | None,
        typer.Option(callback=out_folder, help="Output folder (default runs/probe/<config stem>)."),
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Seed (default: the config's).")] = None,
) -> None:
    """The pair's exchange regime before any update: accuracy, all-fail shares, complementarity,
    candidates, compatibility s and what the method would move, for the cost of a rollout."""
    from graftrl.config import load_config
    from graftrl.experiments.probe import run_probe

    overrides = [*(set_ or []), *([f"seed={seed}"] if seed is not None else [])]
    cfg = load_config(config, overrides)
    folder = out or Path("runs") / "probe" / config.stem
    result = run_probe(
        cfg, folder, prompts, config_path=str(config), progress=cfg.logging.progress, on_checked=thread_note
    )
    console.print(result.folder.report.read_text(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {result.folder.json}, {result.folder.report} and {len(result.plots)} plots")


@app.command("eval")
def eval_command(
    target: Annotated[
        Path,
        typer.Argument(
            help="A run directory (evaluates each of its policies) or a Hugging Face checkpoint folder."
        ),
    ],
    best: Annotated[
        bool,
        typer.Option("--best", help="Evaluate the run's validation-selected checkpoints (RUN_DIR/best/)."),
    ] = False,
    benchmark: Annotated[
        list[str] | None,
        typer.Option(
            "--benchmark",
            "-b",
            help="NAME=PATH (JSONL/Parquet with problem/answer), a file, a hub dataset id or a built-in "
            "name (MATH500, AIME2024, AIME2025, AMC23, Minerva); repeatable. Default: the five built-ins.",
        ),
    ] = None,
    runs: Annotated[int, typer.Option(min=1, help="Independent runs (sampling seeds); mean ± std.")] = 5,
    samples: Annotated[int, typer.Option(min=1, help="Samples per problem.")] = 8,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (> 0).")] = 0.6,
    top_p: Annotated[float, typer.Option(help="Nucleus mass, in (0, 1].")] = 0.95,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(min=1, help="Response length limit (default: the run's rollout limit, else 4096)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            callback=out_folder,
            help="Output folder (default RUN_DIR/eval, RUN_DIR/eval-best or runs/eval/NAME).",
        ),
    ] = None,
    template: Annotated[
        str | None,
        typer.Option(help="Prompt template with {problem} (default: the run's, else '{problem}')."),
    ] = None,
    chat_template: Annotated[
        bool | None,
        typer.Option("--chat-template/--no-chat-template", help="Use the tokenizer's chat template."),
    ] = None,
    prompt_suffix: Annotated[
        str | None,
        typer.Option(help="Suffix after each problem (default: the run's, else the paper's); '' for none."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the first run; run r uses seed + r.")] = 0,
    workers: Annotated[
        int | None, typer.Option(min=1, help="Verifier worker processes (default: min(4, CPUs)).")
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(help="Per-answer verification timeout in seconds (default: the run's, else 5)."),
    ] = None,
    max_problems: Annotated[
        int | None, typer.Option(min=1, help="Only the first this many problems of each benchmark.")
    ] = None,
    max_batch_size: Annotated[
        int | None, typer.Option(min=1, help="Rows (prompt x sample) per generate call.")
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16.")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu, cuda, cuda:1, ...")] = None,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
) -> None:
    """Evaluate checkpoints with the paper's protocol: pass@1 (and pass@k) over R runs."""
    from graftrl.config import ConfigError
    from graftrl.config.rewards import RewardConfig
    from graftrl.evaluation.benchmarks import PAPER_BENCHMARKS, load_benchmarks
    from graftrl.evaluation.evaluate import (
        EvalProtocol,
        check_prompts,
        default_prompt_suffix,
        evaluate_targets,
        resolve_targets,
        write_report,
    )
    from graftrl.models.rollout import HFRolloutEngine
    from graftrl.verifiers.registry import build_verifier

    if temperature <= 0 or not 0 < top_p <= 1 or (timeout is not None and timeout <= 0):
        raise ConfigError("--temperature and --timeout must be > 0 and --top-p in (0, 1]")
    plan = resolve_targets(target, best, template, chat_template, dtype, device)
    out = ensure_writable(out or plan.default_out, "--out")  # before the work, not after it
    config = plan.config
    # The run's verifier (its reward.kind, as the run was rewarded; math for a bare folder) with
    # this command's workers and timeout, and no overall deadline: every answer is verified.
    reward = config.reward if config else RewardConfig()
    reward = reward.model_copy(
        update={
            "timeout_s": timeout or reward.timeout_s,
            "workers": workers or min(4, os.cpu_count() or 1),
            "deadline_s": None,
        }
    )
    verifier = build_verifier(reward)
    try:
        # each row checked by the verifier as it loads (one line naming the file, row and field)
        benchmarks = load_benchmarks(
            benchmark or list(PAPER_BENCHMARKS), max_problems, check=verifier.check_problem
        )
        protocol = EvalProtocol(
            samples=samples,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens or (config.rollout.max_new_tokens if config else 4096),
            prompt_suffix=(prompt_suffix or None)
            if prompt_suffix is not None
            else default_prompt_suffix(config),
            runs=runs,
            seed=seed,
            success_threshold=reward.success_threshold,
        )
        check_prompts(plan.targets, benchmarks, protocol)  # before any model loads (evaluate_targets again)
        engine = HFRolloutEngine(
            max_batch_size or (config.rollout.max_batch_size if config else 512),
            share_prompts=config.rollout.share_prompts if config else True,
            compile=config.rollout.compile if config else "auto",
        )
        verifier.start()  # its workers and self-check, before any weights load (VerifierError: one line)
        console.print(
            f"evaluating {', '.join(t.label for t in plan.targets)} on "
            f"{', '.join(f'{b.name} ({len(b.problems)})' for b in benchmarks)}: {runs} run(s) x {samples} "
            f"samples, T={temperature}, top-p={top_p}, max {protocol.max_new_tokens} new tokens"
        )
        thread_note()
        report = evaluate_targets(plan.targets, benchmarks, verifier, protocol, engine, progress)
    finally:
        verifier.close()
    paths = write_report(report, out)
    console.print(paths["markdown"].read_text(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {paths['json']}, {paths['markdown']}, {paths['plot']}")


@app.command("import-trajectories")
def import_trajectories_command(
    file: Annotated[Path, typer.Argument(help="JSONL of trajectories logged by another framework.")],
    store: Annotated[Path, typer.Option(help="Trajectory store folder to write (created if absent).")],
    model: Annotated[
        Path | None,
        typer.Option(help="Source model folder: computes log-probs for lines that lack them."),
    ] = None,
    template: Annotated[
        str, typer.Option(help="The source's prompt template with {problem} (used with --model).")
    ] = "{problem}",
    chat_template: Annotated[
        bool, typer.Option(help="Use the source tokenizer's chat template instead of --template.")
    ] = False,
    source: Annotated[
        str | None,
        typer.Option(help="Source name for lines without 'source' (default: model folder or file name)."),
    ] = None,
    temperature: Annotated[
        float, typer.Option(help="The source's sampling temperature (log-probs of logits / T).")
    ] = 1.0,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, ... (with --model).")] = "auto",
) -> None:
    """Import external rollouts as a peer's trajectory store (see graftrl.training.importer)."""
    from graftrl.training.importer import import_jsonl

    summary = import_jsonl(
        file,
        store,
        model,
        template,
        source=source,
        chat_template=chat_template,
        temperature=temperature,
        device=device,
    )
    if summary.unequal_groups:
        console.print(f"[yellow]note:[/yellow] {escape(summary.unequal_groups)}", soft_wrap=True)
    console.print(
        f"imported {summary.rows} responses in {summary.groups} groups from {', '.join(summary.sources)} "
        f"into {store} (steps {summary.steps[0]}..{summary.steps[-1]}; log-probs computed for "
        f"{summary.scored}, advantages for {summary.computed_advantages} groups)"
    )


@app.command()
def analyze(
    run_dir: Annotated[Path, typer.Argument(help="Run folder written by `graftrl train`.")],
    out: Annotated[
        Path | None, typer.Option(callback=out_folder, help="Output folder (default RUN_DIR/analysis).")
    ] = None,
    store: Annotated[
        Path | None, typer.Option(help="Trajectory store to check against (default RUN_DIR/store).")
    ] = None,
) -> None:
    """Diagnostics of a run: complementarity, exchange, s/w, clipping, curves, compute."""
    from graftrl.reporting.analysis_report import write_analysis
    from graftrl.reporting.analyze import analyze_run
    from graftrl.storage.rundir import RunDir

    result = analyze_run(run_dir, store_dir=store)
    written = write_analysis(result, ensure_writable(out or RunDir(run_dir).analysis, "--out"))
    comp = result.compute
    console.print(
        f"{len(result.steps)} steps of {', '.join(result.models)}; "
        f"{comp.total_hours:.4g} accelerator-hours in total"
    )
    if result.store_ok is False:
        first = next((line for line in (result.store_report or "").splitlines() if line.strip()), "")
        console.print(
            f"[yellow]warning:[/yellow] the trajectory store has problems ({escape(first.strip())}); see the report",
            soft_wrap=True,
        )
    console.print(f"wrote {written.report} and {len(written.plots)} plots")
