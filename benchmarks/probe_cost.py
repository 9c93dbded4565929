"""What `graftrl probe` costs against the rollout plus peer scoring of a training step, same prompts.

Target (issue 39): a probe step costs at most 1.2x a training step's rollout and peer scoring on
the same prompts. Runs the demo's configuration on the embedded pair (``demo_config``: two
warm-started ~1M models, 32 prompts x n = 8, GRAFT) in one process and, for each repeat r,
interleaved (the side that goes first alternates):

- training: ``Trainer.step(r)`` of one trainer whose weights are put back to the initial ones
  first (step r's prompts, seeds and weights: the probe's samples, checked by the rewards). Its
  rollout plus peer scoring: the wall-clock and CPU-seconds of ``Trainer.exchange`` (sampling,
  verifying, planning) and of each policy's row building in its update (``rows.build_rows``:
  re-tokenizing, the no-grad scoring pass, s, w, the contrast); the optimizer's part left out;
- probe: ``Probe.step(r)``, the same prompts, seeds and weights (so the same samples): wall-clock
  and CPU-seconds of the whole probe step (sampling, verifying, planning, scoring every candidate
  group, building the method's rows).

It prints per repeat and the geometric mean of probe / training with its 95% t interval (over
log ratios), in wall-clock and in CPU-seconds of this process (the verifier's worker process is
not counted on either side), and the probe's update estimate (``probe_stats.UPDATE_FORWARDS``
rule) against the update the training step measured. The first ``--warmup`` pairs (first calls,
imports, allocator and verifier warm-up) are run and left out.

    PYTHONPATH=src .venv/bin/python benchmarks/probe_cost.py --repeats 6 --threads 1 --json out.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=6, help="interleaved (training, probe) pairs")
    ap.add_argument(
        "--warmup", type=int, default=1, help="pairs run first and left out (first calls, imports, caches)"
    )
    ap.add_argument("--task", default="worked", help="embedded task whose pair and data are used")
    ap.add_argument("--method", default="graft")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument(
        "--cache-dir", default=None, help="embedded model cache (default ~/.cache/graftrl/embedded)"
    )
    ap.add_argument("--set", action="append", default=[], help="config override KEY=VALUE")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return ap.parse_args(argv)


def geometric_interval(ratios: list[float]) -> tuple[float, float | None, float | None]:
    """Geometric mean of ``ratios`` and its 95% Student t interval (over their logarithms)."""
    from scipy.stats import t as student_t

    logs = [math.log(r) for r in ratios]
    centre = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(centre), None, None
    half = student_t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(centre), math.exp(centre - half), math.exp(centre + half)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    C.set_threads(args.threads)
    C.quiet_hf()
    if note := C.contention_note(args.threads):
        print(note)
    from graftrl.config import apply_overrides, config_from_dict
    from graftrl.embedded.task import make_split
    from graftrl.experiments.compare.task import demo_config, demo_settings, write_problems
    from graftrl.experiments.probe import step_data
    from graftrl.experiments.probe_steps import Probe, probe_config
    from graftrl.models.rewards import MathVerifier
    from graftrl.reporting.probe_stats import UPDATE_FORWARDS
    from graftrl.storage.data import PromptSampler, load_problems
    from graftrl.training.trainer import Trainer

    settings = demo_settings(args.task)
    paths = C.embedded_paths(args.cache_dir, args.task)
    work = Path(tempfile.mkdtemp(prefix="probe_cost-"))
    train, _ = make_split(seed=0, n_train=settings.n_train, n_eval=settings.n_eval, task=args.task)
    write_problems(train, work / "train.jsonl")
    raw = demo_config(paths, work / "train.jsonl", args.method, 0, settings)
    raw["logging"] = {"progress": False, "log_samples": 0}
    config = config_from_dict(apply_overrides(raw, args.set))
    config, _ = probe_config(config)  # the same config on both sides
    problems = load_problems(config.data.train)
    sampler = PromptSampler(problems, config.train.batch_prompts, config.seed)
    rows: list[dict[str, Any]] = []
    with MathVerifier.from_config(config.reward) as verifier:
        probe = Probe(config, work / "probe", problems=problems, verifier=verifier)
        training = TrainingSide(Trainer(config, work / "run", problems=problems, verifier=verifier))
        try:
            for r in range(args.warmup + args.repeats):
                batch = sampler.batch(r)
                sides = ("training", "probe") if r % 2 == 0 else ("probe", "training")
                row: dict[str, Any] = {"step": r, "first": sides[0]}
                for side in sides:
                    if side == "probe":
                        wall, cpu = time.perf_counter(), time.process_time()
                        result = probe.step(r, batch)
                        row["probe_wall"] = time.perf_counter() - wall
                        row["probe_cpu"] = time.process_time() - cpu
                        data, _ = step_data(result, config.rollout.n)
                        forwards = UPDATE_FORWARDS * config.train.update_epochs
                        row["update_estimate"] = sum(
                            forwards
                            * (c["time_peer_logprob"] + c["candidates_time_peer_logprob"])
                            / c["scored_tokens"]
                            * c["update_tokens"]
                            for c in data.costs.values()
                            if c["scored_tokens"]
                        )
                        row["probe_rewards"] = {name: m["reward_mean"] for name, m in result.metrics.items()}
                    else:
                        row.update(training.step(r))
                if row["probe_rewards"] != row.pop("training_rewards"):
                    raise RuntimeError(f"step {r}: the probe and the training step sampled differently")
                row.pop("probe_rewards")
                row["ratio_wall"] = row["probe_wall"] / row["training_wall"]
                row["ratio_cpu"] = row["probe_cpu"] / row["training_cpu"]
                if r >= args.warmup:
                    rows.append(row)
                print(
                    f"{'warm-up ' if r < args.warmup else ''}step {r}: training {row['training_wall']:.2f} s ({row['training_cpu']:.2f} CPU-s), "
                    f"probe {row['probe_wall']:.2f} s ({row['probe_cpu']:.2f} CPU-s), "
                    f"ratio {row['ratio_wall']:.3f} wall / {row['ratio_cpu']:.3f} CPU; update "
                    f"measured {row['update_measured']:.2f} s, estimated {row['update_estimate']:.2f} s",
                    flush=True,
                )
        finally:
            probe.close()
            training.close()
    summary = {
        key: dict(zip(("mean", "low", "high"), geometric_interval([r[key] for r in rows]), strict=True))
        for key in ("ratio_wall", "ratio_cpu")
    }
    summary["update_estimate_over_measured"] = dict(
        zip(
            ("mean", "low", "high"),
            geometric_interval([r["update_estimate"] / r["update_measured"] for r in rows]),
            strict=True,
        )
    )
    print(
        C.table(
            [
                "step",
                "first",
                "training s",
                "probe s",
                "wall ratio",
                "training CPU-s",
                "probe CPU-s",
                "CPU ratio",
            ],
            [
                [
                    r["step"],
                    r["first"],
                    r["training_wall"],
                    r["probe_wall"],
                    r["ratio_wall"],
                    r["training_cpu"],
                    r["probe_cpu"],
                    r["ratio_cpu"],
                ]
                for r in rows
            ],
            title=f"probe step / training step's rollout + peer scoring ({args.method}, {args.task})",
        )
    )
    for key, label in (
        ("ratio_wall", "wall-clock"),
        ("ratio_cpu", "CPU-seconds"),
        ("update_estimate_over_measured", "update estimate / measured"),
    ):
        s = summary[key]
        print(f"{label}: geometric mean {C.fmt(s['mean'])} [95% {C.fmt(s['low'])}, {C.fmt(s['high'])}]")
    payload = {"args": vars(args), "machine": C.machine_info(), "rows": rows, "summary": summary}
    C.write_json(args.json, payload)
    return payload


class TrainingSide:
    """One trainer, its weights put back to the initial ones before each step, so that step r
    samples what the probe's step r samples (same prompts, seeds and weights) on warm models."""

    def __init__(self, trainer: Any) -> None:
        from graftrl.storage.metrics import MetricsLogger
        from graftrl.training.log_schema import metric_keys

        self.trainer = trainer
        self.initial = [{k: v.clone() for k, v in p.model.state_dict().items()} for p in trainer.policies]
        self.spans = {"wall": 0.0, "cpu": 0.0}
        trainer.exchange = self.timed(trainer.exchange)  # the rollout and planning
        trainer.logger = MetricsLogger(trainer.run_dir, keys=metric_keys())

    def timed(self, function: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return function(*a, **k)
            finally:
                self.spans["wall"] += time.perf_counter() - wall
                self.spans["cpu"] += time.process_time() - cpu

        return run

    def step(self, step: int) -> dict[str, Any]:
        for policy, state in zip(self.trainer.policies, self.initial, strict=True):
            policy.model.load_state_dict(state)
        self.spans.update(wall=0.0, cpu=0.0)
        # each policy's row building in its update (``rows.build_rows``: re-tokenizing, the no-grad
        # scoring pass, s, w, the contrast), timed only during this step: the probe calls it too
        import graftrl.training.worker as worker_module

        build_rows = worker_module.build_rows
        worker_module.build_rows = self.timed(build_rows)
        try:
            metrics = self.trainer.step(step)
        finally:
            worker_module.build_rows = build_rows
        return {
            "training_wall": self.spans["wall"],
            "training_cpu": self.spans["cpu"],
            "update_measured": sum(m.get("time_update", 0.0) for m in metrics.values()),
            "training_rewards": {name: m["reward_mean"] for name, m in metrics.items()},
        }

    def close(self) -> None:
        assert self.trainer.logger is not None
        self.trainer.logger.close()
        self.trainer.close()


if __name__ == "__main__":
    main()
