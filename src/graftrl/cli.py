"""Command line: `graftrl train`, `graftrl demo`, `graftrl config-reference`, `graftrl metrics-reference`."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Annotated

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from graftrl.embedded.task import DEFAULT_TASK, MASTERY_POINTS, SKILL_OVERLAPS, TASKS
from graftrl.errors import UserError

console = Console()

USER_ERROR_EXIT_CODE = 2
"""Exit code of an anticipated error (bad config, data, model folder, store, checkpoint)."""


def one_line(error: BaseException) -> str:
    """The error's message on one line (multi-part messages joined with '; ')."""
    parts = [part.strip() for part in str(error).splitlines() if part.strip()]
    return " ".join(part if part.endswith(":") else part + ";" for part in parts).rstrip(";")


class _ErrorBoundary(TyperGroup):
    """The CLI's one error boundary: every command runs inside it.

    An anticipated error (any ``graftrl.errors.UserError``, raised where the problem is found, or a
    ``FileNotFoundError`` graftrl raised itself with a message, i.e. without an errno) becomes one
    red line naming the thing and the fix, exit code 2. So does an error of the machine (an
    ``OSError`` with an errno: disk full, permissions, a read-only or vanished path; a
    ``MemoryError``), with the usual fix (``GRAFTRL_TRACEBACK=1`` shows its traceback). Anything
    else is a bug and keeps its traceback.
    """

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except (UserError, FileNotFoundError, OSError, MemoryError) as error:
            if isinstance(error, (OSError, MemoryError)) and not _raised_by_graftrl(error):
                # The machine's answer to a file or resource (disk full, permissions, a read-only
                # or vanished path, memory): the user's environment, not graftrl's logic.
                if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
                    raise
                console.print(f"[red]error:[/red] {escape(environment_error(error))}", soft_wrap=True)
                raise typer.Exit(USER_ERROR_EXIT_CODE) from None
            # A Ray actor's error arrives wrapped (RayTaskError, also an instance of its cause's
            # class) with the remote traceback in its text: print the cause's own message.
            cause = getattr(error, "cause", None)
            message = one_line(cause if isinstance(cause, UserError) else error)
            console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
            raise typer.Exit(USER_ERROR_EXIT_CODE) from None


def _raised_by_graftrl(error: BaseException) -> bool:
    """A FileNotFoundError graftrl raised itself with a message (no errno): a check of ours."""
    return isinstance(error, FileNotFoundError) and error.errno is None


TRACEBACK_ENV = "GRAFTRL_TRACEBACK"
"""Set to 1 to see the traceback of an environment error the CLI reports in one line."""

_ERRNO_FIXES = {
    errno.ENOSPC: "free disk space, then rerun (a training run: --resume)",
    errno.EDQUOT: "free space within your disk quota, then rerun (a training run: --resume)",
    errno.EACCES: "check the path's permissions, or choose another path",
    errno.EPERM: "check the path's permissions, or choose another path",
    errno.EROFS: "the file system is read-only: choose a writable path",
    errno.ENOENT: "check the path (it does not exist, or was removed while graftrl ran)",
    errno.ENOTDIR: "a part of the path is a file, not a folder: check the path",
    errno.EISDIR: "the path is a folder where a file was expected: check the path",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n) or lower reward.workers",
}


def environment_error(error: OSError | MemoryError) -> str:
    """One line for an error the machine raised: what, where, and the usual fix."""
    if isinstance(error, MemoryError):
        return (
            "out of memory; lower train.micro_batch_size / micro_batch_tokens or rollout.max_batch_size, "
            f"or check `graftrl estimate-memory` (set {TRACEBACK_ENV}=1 for the traceback)"
        )
    where = f" ({error.filename})" if error.filename else ""
    what = error.strerror or one_line(error) or type(error).__name__
    fix = _ERRNO_FIXES.get(error.errno or -1, "check the file or resource it names")
    return f"{what}{where}: {fix} (set {TRACEBACK_ENV}=1 for the traceback)"


def _out_folder(value: Path | None) -> Path | None:
    """``--out`` names a folder (new or existing): refuse a path that is an existing file."""
    if value is not None and value.exists() and not value.is_dir():
        raise UserError(
            f"--out {value}: is a file, not a folder; give a folder path (a new one is created, an "
            "existing folder is used)"
        )
    return value


app = typer.Typer(
    cls=_ErrorBoundary,
    add_completion=False,
    no_args_is_help=True,
    help="Cross-model trajectory exchange for RLVR.",
)

_TASK_HELP = "Embedded task: " + "; ".join(f"{t.name} = {t.description}" for t in TASKS.values()) + "."


def _check_task(name: str) -> None:
    """An unknown --task ends with one line naming the known tasks."""
    if name not in TASKS:
        raise UserError(f"--task {name!r} is not an embedded task; known: {', '.join(TASKS)}")


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask (taskset, a container's cpuset), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def torch_threads(cpus: int, processes: int = 1, requested: int | None = None) -> int:
    """torch intra-op threads for each of ``processes`` torch processes sharing ``cpus`` CPUs.

    ``requested`` (``--threads``) wins; otherwise an equal share of the CPUs, at least 1. The choice
    depends only on the machine's CPUs, never on its momentary load: the thread count changes the
    order of float reductions, so a load-dependent choice would make a resumed run differ from an
    uninterrupted one.
    """
    if requested is not None:
        return max(1, requested)
    return max(1, cpus // max(1, processes))


def contention_note(threads: int, cpus: int, load: float) -> str | None:
    """A hint when other work already keeps some of the CPUs busy (1-minute load average ``load``).

    torch's OpenMP threads spin at barriers: with 2 threads per process and another busy process on
    2 cores, a 60-step embedded run took more than 8 minutes instead of ~70 s. None when the run's
    threads fit on the CPUs left free (or it uses 1 thread).
    """
    free = max(1, cpus - round(load))
    if threads <= free:
        return None
    return (
        f"the CPUs are busy (load average {load:.1f} on {cpus} CPUs) and torch uses {threads} threads, "
        f"which spin when cores are shared; if this run is slow, give it --threads {free} "
        f"(or GRAFTRL_THREADS={free}), 1 per process when several graftrl runs share the machine"
    )


_TORCH_COMMANDS = frozenset({"train", "demo", "compare", "sweep", "eval", "import-trajectories"})
"""Subcommands that run models, so their torch thread count matters."""

_thread_notes: list[str] = []
"""The contention hint of this invocation, printed by the command once its inputs check out."""


@app.callback()
def _setup(
    ctx: typer.Context,
    threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            envvar="GRAFTRL_THREADS",
            help="torch intra-op threads of this process (default: one per CPU it may use). Give each "
            "of several graftrl processes sharing the machine cores / processes (e.g. 1): torch's "
            "threads spin when cores are shared, which can make a run several times slower. Ray "
            "actors and FSDP ranks set their own (resources.num_cpus, 1).",
        ),
    ] = None,
) -> None:
    """graftrl shows its own progress; silence per-file load/save bars of transformers (here and in
    the workers a command spawns)."""
    from graftrl.console import quiet_transformers
    from graftrl.interrupts import install

    quiet_transformers()
    install()  # Ctrl-C stops a run even when a finalizer swallowed the KeyboardInterrupt
    if ctx.invoked_subcommand not in _TORCH_COMMANDS:
        return
    import torch

    cpus = available_cpus()
    # The default never raises torch's own count (already lowered, e.g. by OMP_NUM_THREADS or a test).
    chosen = torch_threads(cpus, requested=threads)
    if threads is None:
        chosen = min(chosen, torch.get_num_threads())
    torch.set_num_threads(chosen)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    note = None if threads is not None else contention_note(chosen, cpus, load)
    _thread_notes[:] = [note] if note else []


def _thread_note() -> None:
    """Print the contention hint of ``_setup`` (once the command has passed its input checks)."""
    while _thread_notes:
        console.print(f"[yellow]note:[/yellow] {escape(_thread_notes.pop())}", soft_wrap=True)


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="YAML config file.")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a field: --set train.steps=10")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(callback=_out_folder, help="Run directory (default runs/<config stem>).")
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
    run_dir = _out_folder(out or Path("runs") / config.stem)
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
        _thread_note()
        trainer.train(resume=resume, force=force)
    console.print(f"run written to {run_dir}")


_REUSE_HELP = (
    "A compare or sweep output folder (repeatable) whose finished cells stand in for this run's: a "
    "cell with the same digest (the same models, data, config and evaluation, under any variant "
    "name) is copied, logs and marker, instead of trained."
)
_JOBS_HELP = (
    "Cells trained side by side, each in its own process with an equal share of this process's torch "
    "threads (on 2 cores, 2 jobs of 1 thread beat 1 job of 2 threads: the models are tiny)."
)
# The options demo, compare and sweep share, declared once.
_Cache = Annotated[Path | None, typer.Option(help="Where warm-started models are cached.")]
_Task = Annotated[str, typer.Option(help=_TASK_HELP)]
_Steps = Annotated[int | None, typer.Option(min=1, help="Override train.steps for every cell.")]
_Quick = Annotated[bool, typer.Option(help="Smoke-test sizes (the demo's --quick).")]
_Jobs = Annotated[int, typer.Option(min=1, help=_JOBS_HELP)]
_Reuse = Annotated[list[Path] | None, typer.Option(help=_REUSE_HELP)]


@app.command()
def demo(
    out: Annotated[
        Path, typer.Option(callback=_out_folder, help="Output folder for runs, plots and results.json.")
    ] = Path("runs/demo"),
    quick: Annotated[bool, typer.Option(help="Smoke-test size (about a minute).")] = False,
    seeds: Annotated[int, typer.Option(min=1, help="Repeat the comparison with this many seeds.")] = 1,
    cache: _Cache = None,
    task: _Task = DEFAULT_TASK,
    jobs: Annotated[
        int | None, typer.Option(min=1, help=_JOBS_HELP + " Default: 2 where 2 CPUs are free to use, else 1.")
    ] = None,
) -> None:
    """Warm-start two tiny heterogeneous models, train GRPO and GRAFT, compare held-out pass@1."""
    from graftrl.reporting.demo import run_demo

    _check_task(task)
    _thread_note()
    jobs = jobs or min(2, available_cpus())
    run_demo(out_dir=out, quick=quick, seeds=seeds, cache_dir=cache, console=console, task=task, jobs=jobs)


@app.command("config-reference")
def config_reference_command(
    markdown: Annotated[bool, typer.Option(help="Print a Markdown table (as in the README).")] = False,
) -> None:
    """Print every config field with its default and description."""
    from graftrl.config import config_reference, config_reference_markdown

    if markdown:
        print(config_reference_markdown(), end="")
        return
    table = Table("key", "default", "description", show_lines=False)
    for key, default, description in config_reference():
        table.add_row(key, default, description)
    console.print(table)


@app.command("metrics-reference")
def metrics_reference_command(
    markdown: Annotated[bool, typer.Option(help="Print Markdown tables (docs/metrics.md).")] = False,
) -> None:
    """Print every key of the run folder's logs (metrics.jsonl, validation.jsonl, ...): meaning and unit."""
    from graftrl.storage.rundir import keys_markdown, logs
    from graftrl.training.log_schema import metric_keys

    declared = metric_keys()  # the trainer's and every method's loss metrics
    if markdown:
        print(keys_markdown(declared), end="")
        return
    for log, keys in logs(declared).items():
        table = Table("key", "meaning", "unit", "group", title=log, title_justify="left")
        for key in keys:
            table.add_row(key.name, key.meaning, key.unit, key.group)
        console.print(table)


@app.command("estimate-memory")
def estimate_memory_command(
    config: Annotated[Path, typer.Argument(help="YAML config file.")],
    gpu_memory: Annotated[
        float | None, typer.Option(help="GiB per GPU (default: this machine's GPU, else 141, an H200).")
    ] = None,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Prompt length assumed per row.")] = 512,
    ranks: Annotated[
        int | None,
        typer.Option(min=1, help="FSDP ranks per policy (default: each policy's parallel.data, else 1)."),
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a field: --set train.micro_batch_tokens=16384")
    ] = None,
) -> None:
    """Per-GPU memory of a config (parameters, gradients, AdamW, activations, logits, vLLM), offline:
    only each model's config.json is read. Exit code 1 when it does not fit."""
    from graftrl.config import ConfigError, load_config
    from graftrl.models.memory import GIB, estimate_config, fit_message, memory_table

    try:
        cfg = load_config(config, set_ or [])
        if gpu_memory is None:
            import torch

            gpu_memory = torch.cuda.mem_get_info()[1] / GIB if torch.cuda.is_available() else 141.0
        estimates, total = estimate_config(cfg, gpu_memory * GIB, prompt_tokens, ranks=ranks)
    except ConfigError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None
    console.print(memory_table(estimates, total, gpu_memory * GIB))
    message = fit_message(total, gpu_memory * GIB)
    if message is not None:
        console.print(f"[red]does not fit:[/red] {message}")
        raise typer.Exit(1)
    console.print(f"fits: {total / GIB:.1f} of {gpu_memory:.0f} GiB per GPU")


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
            callback=_out_folder,
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
    from graftrl.evaluation.benchmarks import PAPER_BENCHMARKS, load_benchmarks
    from graftrl.evaluation.evaluate import (
        EvalProtocol,
        default_prompt_suffix,
        evaluate_targets,
        resolve_targets,
        write_report,
    )
    from graftrl.models.rewards import MathVerifier
    from graftrl.models.rollout import HFRolloutEngine

    if temperature <= 0 or not 0 < top_p <= 1 or (timeout is not None and timeout <= 0):
        raise ConfigError("--temperature and --timeout must be > 0 and --top-p in (0, 1]")
    plan = resolve_targets(target, best, template, chat_template, dtype, device)
    benchmarks = load_benchmarks(benchmark or list(PAPER_BENCHMARKS), max_problems)
    config = plan.config
    protocol = EvalProtocol(
        samples=samples,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens or (config.rollout.max_new_tokens if config else 4096),
        prompt_suffix=(prompt_suffix or None) if prompt_suffix is not None else default_prompt_suffix(config),
        runs=runs,
        seed=seed,
    )
    engine = HFRolloutEngine(max_batch_size or (config.rollout.max_batch_size if config else 512))
    verifier = MathVerifier(
        timeout_s=timeout or (config.reward.timeout_s if config else 5.0),
        workers=workers or min(4, os.cpu_count() or 1),
        extraction=config.reward.extraction if config else "last_box",  # as the run was rewarded
    )
    console.print(
        f"evaluating {', '.join(t.label for t in plan.targets)} on "
        f"{', '.join(f'{b.name} ({len(b.problems)})' for b in benchmarks)}: {runs} run(s) x {samples} "
        f"samples, T={temperature}, top-p={top_p}, max {protocol.max_new_tokens} new tokens"
    )
    _thread_note()
    try:
        verifier.start()
        report = evaluate_targets(plan.targets, benchmarks, verifier, protocol, engine, progress)
    finally:
        verifier.close()
    paths = write_report(report, out or plan.default_out)
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
        Path | None, typer.Option(callback=_out_folder, help="Output folder (default RUN_DIR/analysis).")
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
    written = write_analysis(result, out or RunDir(run_dir).analysis)
    comp = result.compute
    console.print(
        f"{len(result.steps)} steps of {', '.join(result.models)}; "
        f"{comp.total_hours:.4g} accelerator-hours in total"
    )
    if result.store_ok is False:
        console.print("[yellow]warning:[/yellow] the trajectory store has problems; see the report")
    console.print(f"wrote {written.report} and {len(written.plots)} plots")


@app.command()
def compare(
    preset: Annotated[
        str | None,
        typer.Option(
            help="Built-in matrix: table1 (GRPO n=8/16/32, SGT, HACPO, GRAFT), table2 (GRAFT ablations) or demo "
            "(GRPO and GRAFT, as `graftrl demo`). "
            "Default table1 unless --matrix is given."
        ),
    ] = None,
    matrix: Annotated[
        Path | None,
        typer.Option(
            help="YAML matrix: a list of {variant: NAME, method: METHOD, set: {dotted.key: value}}."
        ),
    ] = None,
    seeds: Annotated[int, typer.Option(min=1, help="Seeds 0..K-1 per variant (mean ± std over them).")] = 1,
    steps: _Steps = None,
    quick: _Quick = False,
    out: Annotated[
        Path | None,
        typer.Option(
            callback=_out_folder, help="Output folder (default runs/compare/<preset or matrix name>)."
        ),
    ] = None,
    cache: _Cache = None,
    task: _Task = DEFAULT_TASK,
    jobs: _Jobs = 1,
    reuse: _Reuse = None,
    report_only: Annotated[
        bool,
        typer.Option(
            "--report-only",
            help="Train nothing: write the report from the cells finished so far (here or in --reuse folders).",
        ),
    ] = False,
) -> None:
    """Run a methods x seeds matrix on the embedded task; resumes a partly finished matrix."""
    from graftrl.reporting.compare import run_compare
    from graftrl.reporting.matrix import CompareError, load_matrix

    _check_task(task)
    if preset is not None and matrix is not None:
        raise CompareError("give --preset or --matrix, not both")
    spec = load_matrix(matrix) if matrix is not None else (preset or "table1")
    name = matrix.stem if matrix is not None else (preset or "table1")
    _thread_note()
    run_compare(
        out or Path("runs/compare") / name,
        spec,
        seeds=seeds,
        steps=steps,
        quick=quick,
        cache_dir=cache,
        console=console,
        embedded=task,
        jobs=jobs,
        reuse=reuse or [],
        report_only=report_only,
    )


@app.command()
def sweep(
    overlaps: Annotated[
        str,
        typer.Option(
            help="Skill-overlap points in [0, 1], comma-separated: the GPT-2's warm-start mix is "
            "(1 - o) x its own + o x the Llama's (0: complementary deficits, 1: same skills)."
        ),
    ] = ",".join(f"{o:g}" for o in SKILL_OVERLAPS),
    knob: Annotated[
        str,
        typer.Option(
            help="What the points move: `overlap` (the skill overlap of the pair; GRPO vs GRAFT at "
            "--overlaps) or `mastery` (the peer's mastery of the step the receiver lacks; GRPO, GRAFT, "
            "success-only transfer and SGT at --points)."
        ),
    ] = "overlap",
    points: Annotated[
        str,
        typer.Option(
            help="--knob mastery's points, comma-separated: `default` (the task's pair) or a drilled "
            "pair's own regrouping share in (0, 1]."
        ),
    ] = ",".join(MASTERY_POINTS),
    seeds: Annotated[int, typer.Option(min=1, help="Seeds 0..K-1 per point and method.")] = 5,
    steps: _Steps = None,
    quick: _Quick = False,
    out: Annotated[
        Path, typer.Option(callback=_out_folder, help="Output folder (a compare per point inside).")
    ] = Path("runs/sweep"),
    cache: _Cache = None,
    task: _Task = DEFAULT_TASK,
    jobs: _Jobs = 1,
    reuse: _Reuse = None,
) -> None:
    """Where does exchange help? GRAFT - GRPO (n = 8) over the skill overlap of the pair, or which
    transfer rule wins where along the peer's mastery of the receiver's missing step; resumable."""
    from graftrl.reporting.sweep import SweepError, run_sweep

    _check_task(task)
    if knob == "mastery":
        from graftrl.reporting.mastery import run_mastery

        _thread_note()
        run_mastery(
            out,
            [part.strip() for part in points.split(",") if part.strip()],
            seeds=seeds,
            steps=steps,
            quick=quick,
            cache_dir=cache,
            console=console,
            task=task,
            jobs=jobs,
            reuse=reuse or [],
        )
        return
    if knob != "overlap":
        raise SweepError(f"--knob: `overlap` or `mastery`, got {knob!r}")
    try:
        points = [float(part) for part in overlaps.split(",") if part.strip()]
    except ValueError:
        raise SweepError(
            f"--overlaps: numbers separated by commas, e.g. 0,0.1,0.33,1; got {overlaps!r}"
        ) from None
    _thread_note()
    run_sweep(
        out,
        points,
        seeds=seeds,
        steps=steps,
        quick=quick,
        cache_dir=cache,
        console=console,
        task=task,
        jobs=jobs,
        reuse=reuse or [],
    )


def main() -> None:  # pragma: no cover - console entry
    app(sys.argv[1:])


if __name__ == "__main__":  # pragma: no cover
    app()
