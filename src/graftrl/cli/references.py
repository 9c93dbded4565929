"""The reference commands, which read and print: ``config-reference``, ``metrics-reference`` and
``estimate-memory``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from graftrl.cli.common import app, console


@app.command("config-reference")
def config_reference_command(
    markdown: Annotated[bool, typer.Option(help="Print a Markdown table (as in docs/config.md).")] = False,
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
    from graftrl.storage.log_keys import keys_markdown, logs
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
        console.print(f"[red]error:[/red] {escape(str(error))}", soft_wrap=True)  # one line
        raise typer.Exit(2) from None
    console.print(memory_table(estimates, total, gpu_memory * GIB))
    for peer in (p for p in cfg.peers if p.served):
        console.print(
            f"served peer {peer.name}: {peer.model} at {peer.endpoint} takes no memory here (its answers are "
            "scored by each receiver like any peer's rows, which the table counts)",
            soft_wrap=True,
        )
    message = fit_message(total, gpu_memory * GIB)
    if message is not None:
        console.print(f"[red]does not fit:[/red] {message}")
        raise typer.Exit(1)
    console.print(f"fits: {total / GIB:.1f} of {gpu_memory:.0f} GiB per GPU")
