"""What a user sees in a terminal (issue 23): graftrl's own bars for the warm-start and for each
cell, and none of transformers' per-file bars, in graftrl's commands and the workers they spawn,
while a user's own process keeps transformers as it was. Each case runs in a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import FIXTURES, SRC

TESTS = Path(__file__).parent
TRANSFORMERS_BARS = ("Loading weights", "Writing model shards")


def in_terminal(script: str, *args: str, timeout: float = 900) -> str:
    """Run ``script`` (Python source) in a pseudo-terminal 160 columns wide; its whole output."""
    main, child = pty.openpty()
    env = {
        **{k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"},
        "PYTHONPATH": f"{SRC}{os.pathsep}{TESTS}",
        "COLUMNS": "160",
        "TERM": "xterm-256color",
        "GRAFTRL_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args], stdout=child, stderr=child, env=env
    )
    os.close(child)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([main], [], [], timeout)
            if not ready:
                raise TimeoutError(f"no output for {timeout} s")
            try:
                data = os.read(main, 65536)
            except OSError:  # the terminal closed: the process is gone
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(main)
        process.wait(timeout=60)
    output = b"".join(chunks).decode("utf-8", errors="replace")
    assert process.returncode == 0, output[-3000:]
    return output


def test_the_warm_start_shows_a_bar_per_model_with_its_sampled_accuracy(tmp_path):
    """compare's warm-start: each model's step of its maximum, the accuracy it stops at, the time
    left; its workers write their checkpoints without transformers' bars."""
    output = in_terminal(
        """
        import sys
        from pathlib import Path
        from rich.console import Console
        from graftrl.experiments.compare.task import embedded_task

        settings = {"max_steps": 3, "target_accuracy": 1.0, "check_every_steps": 2, "check_problems": 2,
                    "batch_size": 8}
        embedded_task(Path(sys.argv[1]), Path(sys.argv[2]), True, Console(), warmstart=settings)
        """,
        str(tmp_path / "out"),
        str(tmp_path / "cache"),
    )
    for model in ("llama-char", "gpt2-bpe"):
        assert f"warm-start {model}" in output
    assert "3/3" in output and "sampled accuracy" in output and "stops at 100% (or step 3)" in output
    assert not any(bar in output for bar in TRANSFORMERS_BARS), output[-2000:]


def test_cells_side_by_side_show_their_steps_and_no_transformers_bars(tiny_checkpoints, tmp_path):
    """compare with jobs = 2 as the CLI runs it: a bar per cell and one for the cells done; the
    spawned cells load and save models quietly."""
    output = in_terminal(
        """
        import sys
        from pathlib import Path
        from rich.console import Console
        from conftest import FIXTURES, make_config, task_of
        from graftrl.console import quiet_transformers
        from graftrl.embedded.base import DemoSettings
        from graftrl.experiments.compare.command import run_compare
        from graftrl.reporting.provenance import results_provenance
        from graftrl.storage.data import load_problems

        quiet_transformers()  # what the CLI does first
        paths = {"llama": Path(sys.argv[1]), "gpt2": Path(sys.argv[2])}
        base = make_config(paths, steps=2)
        del base["method"], base["seed"]
        settings = DemoSettings(steps=2, batch_prompts=4, minibatch_prompts=2, n=4, max_new_tokens=8,
                                n_eval=3, eval_samples=2)
        problems = load_problems(FIXTURES / "math_small.jsonl")[:3]
        task = task_of(base, problems, settings, results_provenance(paths))
        run_compare(Path(sys.argv[3]), "demo", task=task, jobs=2, console=Console())
        """,
        str(tiny_checkpoints["llama"]),
        str(tiny_checkpoints["gpt2"]),
        str(tmp_path / "cmp"),
    )
    assert "grpo seed 0" in output and "graft seed 0" in output and "cells done" in output
    assert "2/2" in output
    assert not any(bar in output for bar in TRANSFORMERS_BARS), output[-2000:]


def test_the_cli_is_quiet_and_a_users_process_is_left_alone(tiny_checkpoints, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"""
        method: graft
        seed: 3
        policies:
          - {{name: llama, path: {tiny_checkpoints["llama"]}, template: "{{problem}}="}}
          - {{name: gpt2, path: {tiny_checkpoints["gpt2"]}, template: "Q: {{problem}}"}}
        data: {{train: {FIXTURES / "math_small.jsonl"}, prompt_suffix: null}}
        rollout: {{n: 4, max_new_tokens: 8}}
        train: {{steps: 2, batch_prompts: 4, minibatch_prompts: 2}}
        checkpoint: {{every: 1}}
        """.replace("\n        ", "\n")
    )
    output = in_terminal(
        "from graftrl.cli import main; main()", "train", str(config), "--out", str(tmp_path / "run")
    )
    assert "graft train" in output and "2/2" in output  # graftrl's own bar
    assert not any(bar in output for bar in TRANSFORMERS_BARS), output[-2000:]
    # importing and using graftrl as a library changes nothing of transformers' for the user
    untouched = in_terminal(
        """
        import os
        import graftrl.experiments.compare.command, graftrl.training.trainer, graftrl.embedded.warmstart
        from transformers.utils import logging
        assert logging.is_progress_bar_enabled() and "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
        print("untouched")
        """
    )
    assert "untouched" in untouched
