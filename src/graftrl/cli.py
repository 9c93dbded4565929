"""Command line: `graftrl train`, `graftrl demo`, `graftrl config-reference`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Cross-model trajectory exchange for RLVR."
)
console = Console()


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="YAML config file.")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a field: --set train.steps=10")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Run directory (default runs/<config stem>).")] = None,
    resume: Annotated[
        bool, typer.Option(help="Continue from the latest checkpoint in the run directory.")
    ] = False,
) -> None:
    """Train the configured policies with GRPO or GRAFT."""
    from graftrl.config import ConfigError, load_config
    from graftrl.data import DataError

    try:
        cfg = load_config(config, set_ or [])
        run_dir = out or Path("runs") / config.stem
        if run_dir.exists() and any(run_dir.glob("metrics.jsonl")) and not resume:
            raise ConfigError(
                f"{run_dir} already holds a run; pass --resume to continue it or --out for a new folder"
            )
        from graftrl.trainer import Trainer

        trainer = Trainer(cfg, run_dir)
    except (ConfigError, DataError, FileNotFoundError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None
    trainer.train(resume=resume)
    console.print(f"run written to {run_dir}")


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="Output folder for runs, plots and results.json.")] = Path(
        "runs/demo"
    ),
    quick: Annotated[bool, typer.Option(help="Smoke-test size (about a minute).")] = False,
    seeds: Annotated[int, typer.Option(min=1, help="Repeat the comparison with this many seeds.")] = 1,
    cache: Annotated[Path | None, typer.Option(help="Where warm-started models are cached.")] = None,
) -> None:
    """Warm-start two tiny heterogeneous models, train GRPO and GRAFT, compare held-out pass@1."""
    from graftrl.demo import run_demo

    run_demo(out_dir=out, quick=quick, seeds=seeds, cache_dir=cache, console=console)


@app.command("config-reference")
def config_reference_command(
    markdown: Annotated[bool, typer.Option(help="Print a Markdown table (as in the README).")] = False,
) -> None:
    """Print every config field with its default and description."""
    from graftrl.config import config_reference

    if markdown:
        print("| key | default | description |\n|---|---|---|")
        for key, default, description in config_reference():
            print(f"| `{key}` | {f'`{default}`' if default else ''} | {description} |")
        return
    table = Table("key", "default", "description", show_lines=False)
    for key, default, description in config_reference():
        table.add_row(key, default, description)
    console.print(table)


def main() -> None:  # pragma: no cover - console entry
    app(sys.argv[1:])


if __name__ == "__main__":  # pragma: no cover
    app()
