"""Validation during training and best-checkpoint selection (the paper's rule, section 5.1).

Every ``validation.every`` completed steps (and after the last step) each policy is evaluated on
the validation benchmarks with the evaluation protocol (``validation.samples`` samples per
problem at ``validation.temperature`` / ``validation.top_p``, the training prompt format,
verifier and length limit). Its aggregate is the unweighted mean of the benchmarks' pass@1. The
same rule holds for every method: a policy's checkpoint is kept when its aggregate is strictly
higher than its best so far.

Files in the run directory:

- ``validation.jsonl``: one row per (validation, policy), keyed like ``metrics.jsonl``:
  ``step`` (the 0-based training step just completed), ``model`` (the policy name),
  ``aggregate``, ``pass_at_1/<benchmark>`` per benchmark, ``best`` (the new best?) and
  ``time_validation`` (seconds). A resumed run re-validates the steps it repeats; readers should
  take the last row per (step, model).
- ``best/<policy>/``: the best checkpoint (``save_pretrained`` model + tokenizer) and its
  ``manifest.json`` (size and SHA-256 of each file, as a checkpoint's), replaced atomically:
  written to ``best/<policy>.tmp`` and renamed into place.
- ``best/best.json``: ``{policy: {"step": s, "completed_steps": s + 1, "aggregate": A}}`` with
  ``step`` 0-based as in ``metrics.jsonl`` (the weights after ``s + 1`` training steps, like
  ``checkpoints/step_{s+1:06d}``), replaced atomically.

Validation uses the same sampling seed at every step (so checkpoints are compared on the same
random stream) and restores the global RNG state afterwards, so it never changes training.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from graftrl.config import Config
from graftrl.errors import CheckpointError
from graftrl.evaluation.benchmarks import Benchmark, load_benchmarks
from graftrl.evaluation.evaluate import EvalProtocol, sample_correctness, summarize_benchmark
from graftrl.models.policy import Policy
from graftrl.models.rollout import HFRolloutEngine, RolloutEngine
from graftrl.storage.checkpoint import write_manifest
from graftrl.storage.rundir import RunDir, append_jsonl
from graftrl.verifiers.registry import as_verifier

__all__ = ["Validator"]


class Validator:
    """Called by the trainer after every step; validates when due and keeps the best checkpoints."""

    def __init__(
        self,
        config: Config,
        run_dir: str | Path,
        verifier: Any,
        engine: RolloutEngine | None = None,
        *,
        benchmarks: Sequence[Benchmark] | None = None,
        console: Any = None,
    ) -> None:
        settings = config.validation
        self.run_dir = Path(run_dir)
        self.every = settings.every
        self.total_steps = config.train.steps
        self.verifier = as_verifier(verifier)
        # A worker passes its policy's own engine (HF or vLLM); the default HF engine serves any
        # policy, as direct `validate(step, policies)` calls need.
        self.engine: RolloutEngine = engine or HFRolloutEngine(
            config.rollout.max_batch_size,
            share_prompts=config.rollout.share_prompts,
            compile=config.rollout.compile,
        )
        self.benchmarks = (
            list(benchmarks)
            if benchmarks is not None
            else load_benchmarks(
                settings.specs(), settings.max_problems, check=getattr(self.verifier, "check_problem", None)
            )
        )
        if not self.benchmarks:
            raise ValueError("Validator: no validation benchmarks (set `validation.files`)")
        self.protocol = EvalProtocol(
            samples=settings.samples,
            temperature=settings.temperature,
            top_p=settings.top_p,
            max_new_tokens=settings.max_new_tokens or config.rollout.max_new_tokens,
            prompt_suffix=config.data.prompt_suffix,
            runs=1,
            seed=config.seed,
            success_threshold=config.reward.success_threshold,
        )
        if console is None and config.logging.progress:
            from rich import get_console

            console = get_console()
        self.console = console
        files = RunDir(self.run_dir)
        self.best_dir = files.best
        self.log_path = files.validation
        self.best_file = files.best_index
        self.best: dict[str, dict[str, Any]] = _read_best(self.best_file)

    def due(self, step: int) -> bool:
        """Validate after training step ``step`` (0-based)?"""
        completed = step + 1
        return completed % self.every == 0 or completed == self.total_steps

    def __call__(self, step: int, policies: Sequence[Policy]) -> list[dict[str, Any]] | None:
        """Validate every policy after training step ``step`` (0-based) when due; returns the rows."""
        if not self.due(step):
            return None
        return self.validate(step, policies)

    def validate(self, step: int, policies: Sequence[Policy]) -> list[dict[str, Any]]:
        """Validate every policy now (after 0-based training step ``step``); returns the rows."""
        rows = []
        for policy in policies:
            start = time.perf_counter()
            scores = self.scores(policy)
            rows.append(self.record(step, policy.name, scores, policy.save, time.perf_counter() - start))
        self.report(step, rows)
        return rows

    def scores(self, policy: Policy) -> dict[str, float]:
        """pass@1 per benchmark of the policy's current weights; training's RNG is left untouched."""
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            return {
                b.name: summarize_benchmark(
                    sample_correctness(
                        policy, b.problems, self.verifier, self.protocol, self.protocol.seed, self.engine
                    )
                )["pass_at_1"]
                for b in self.benchmarks
            }

    def record(
        self,
        step: int,
        name: str,
        scores: dict[str, float],
        save: Callable[[str], None],
        seconds: float,
    ) -> dict[str, Any]:
        """Log one policy's scores and keep its weights when they are its best (``save(folder)``)."""
        aggregate = statistics.fmean(scores.values())
        previous = self.best.get(name)
        is_best = previous is None or aggregate > float(previous["aggregate"])
        if is_best:
            self._save_best(name, save, step, aggregate)
        row = {
            "step": step,
            "model": name,
            "aggregate": aggregate,
            **{f"pass_at_1/{bench}": value for bench, value in scores.items()},
            "best": is_best,
            "time_validation": seconds,
        }
        append_jsonl(self.log_path, row)
        return row

    def report(self, step: int, rows: Sequence[dict[str, Any]]) -> None:
        if self.console is not None:
            self.console.print(
                f"validation after {step + 1} steps: "
                + "  ".join(
                    f"{r['model']} {100 * r['aggregate']:.2f}{' (best)' if r['best'] else ''}" for r in rows
                )
            )

    def _save_best(self, name: str, save: Callable[[str], None], step: int, aggregate: float) -> None:
        self.best_dir.mkdir(parents=True, exist_ok=True)
        final = self.best_dir / name
        staging = self.best_dir / f"{name}.tmp"
        retired = self.best_dir / f"{name}.old"
        shutil.rmtree(staging, ignore_errors=True)
        save(str(staging))
        write_manifest(staging, step + 1)  # sealed as checkpoints are: `graftrl eval --best` verifies it
        shutil.rmtree(retired, ignore_errors=True)
        if final.exists():
            final.rename(retired)
        staging.rename(final)
        shutil.rmtree(retired, ignore_errors=True)
        self.best[name] = {"step": step, "completed_steps": step + 1, "aggregate": aggregate}
        tmp = self.best_file.with_name(self.best_file.name + ".tmp")
        tmp.write_text(json.dumps(self.best, indent=1) + "\n")
        os.replace(tmp, self.best_file)


def _read_best(path: Path) -> dict[str, dict[str, Any]]:
    """best/best.json (empty before the first validation). A damaged one is refused in one line:
    starting afresh would let a worse checkpoint replace a better one in best/."""
    if not path.is_file():
        return {}
    try:
        best = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(best, dict) or not all(
            isinstance(entry, dict) and isinstance(entry.get("aggregate"), int | float)
            for entry in best.values()
        ):
            raise ValueError("not a mapping of policy -> {step, completed_steps, aggregate}")
    except ValueError as error:
        raise CheckpointError(
            f"{path}: unreadable ({type(error).__name__}); restore it, or move best/ aside to select the best "
            "checkpoints anew"
        ) from None
    return best
