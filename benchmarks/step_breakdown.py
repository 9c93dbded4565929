"""Where a GRPO step and a GRAFT step spend their time, per model, on the embedded task.

Runs graftrl's Trainer with the demo's configuration (two warm-started ~1M models, a char-level
Llama and a BPE GPT-2; 32 prompts x n = 8 per model per step; 4 optimizer steps per batch) once
with ``method: grpo`` and once with ``method: graft`` from the same weights and seed, and prints

- the median time of each phase per model: rollout, reward, peer log-prob evaluation (GRAFT),
  update, and the model's whole step (``time_step``, the sum of its phases), plus the wall time
  of a whole Trainer step (both models and the exchange planning);
- the ratio GRAFT / GRPO of the per-model step time and of the whole step;
- the predicted ratio 1 + (T_x / T_own) x (c_f / c_s) (see benchmarks/README.md): T_x tokens
  transferred to the model per step, T_own tokens it generated itself, c_f the measured peer
  log-prob time per transferred token, c_s the GRPO step time per own token; and a second
  prediction that also charges the update for the admitted peer tokens it trains on;
- the peak memory per step (``memory_peak_mb`` from the metrics rows when the Trainer logs it,
  else this process's peak RSS per step, reset before each step via /proc/self/clear_refs).

The first ``--warmup`` steps of each method are left out of every statistic.

    PYTHONPATH=src .venv/bin/python benchmarks/step_breakdown.py --steps 30 --warmup 3 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

PHASES = ("time_rollout", "time_reward", "time_peer_logprob", "time_update", "time_step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="measured steps per method (after warm-up)")
    ap.add_argument("--warmup", type=int, default=2, help="steps run first and left out of the figures")
    ap.add_argument("--batch-prompts", type=int, default=32)
    ap.add_argument("--minibatch-prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--micro-batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default="grpo,graft")
    ap.add_argument(
        "--cache-dir", default=None, help="embedded model cache (default ~/.cache/graftrl/embedded)"
    )
    ap.add_argument("--out-dir", default=None, help="keep the run folders here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    ap.add_argument("--set", action="append", default=[], help="extra config override KEY=VALUE")
    return ap.parse_args(argv)


class _MethodProxy:
    """Delegates to the method; records the peer weights w it returns (for admitted tokens)."""

    def __init__(self, method: Any, probe: _Probe) -> None:
        self._method = method
        self._probe = probe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._method, name)

    def peer_weights(self, s, generator):
        w = self._method.peer_weights(s, generator)
        self._probe.last_weights = w
        return w


class _Probe:
    """Counts tokens per policy and step by wrapping the engine, Policy.score and response_logprobs.

    - generated: response tokens the policy sampled (T_own);
    - scored: tokens of peer responses scored without grad (T_x, GRAFT's peer log-prob pass);
    - admitted: of those, tokens in responses the gate admitted (w > 0);
    - grad_tokens: response tokens of forward passes with grad (the update's trained tokens).
    """

    def __init__(self) -> None:
        self.step = -1
        self.counts: dict[tuple[int, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.last_weights = None
        self._pending: tuple[str, list[int]] | None = None

    def install(self, trainer) -> None:
        """Wrap the trainer's engines, methods and policies (in-process backend only)."""
        import torch

        workers = None
        with contextlib.suppress(AttributeError):
            workers = trainer.workers  # PolicyWorker layout: one engine / method per policy
        if workers:
            for worker in workers:
                self._wrap_engine(worker.engine)
                worker.method = _MethodProxy(worker.method, self)
                self._wrap_policy(worker.policy, torch)
            return
        # Older single-loop Trainer: one engine, one method, a list of policies.
        self._wrap_engine(trainer.engine)
        trainer.method = _MethodProxy(trainer.method, self)
        for policy in trainer.policies:
            self._wrap_policy(policy, torch)

    def _wrap_engine(self, engine) -> None:
        probe = self
        original_generate = engine.generate

        def generate(policy, problems, params, *args, **kwargs):
            batch = original_generate(policy, problems, params, *args, **kwargs)
            probe.counts[(probe.step, policy.name)]["generated"] += sum(len(r) for r in batch.response_ids)
            return batch

        engine.generate = generate

    def _wrap_policy(self, policy, torch) -> None:
        probe = self
        original_score = policy.score
        original_logprobs = policy.response_logprobs

        def score(prompts, responses):
            probe._flush()
            out = original_score(prompts, responses)
            lengths = [len(r) for r in responses]
            probe.counts[(probe.step, policy.name)]["scored"] += sum(lengths)
            probe._pending = (policy.name, lengths)
            return out

        def response_logprobs(batch):
            if torch.is_grad_enabled():
                probe._flush()
                probe.counts[(probe.step, policy.name)]["grad_tokens"] += float(batch.response_mask.sum())
            return original_logprobs(batch)

        policy.score = score
        policy.response_logprobs = response_logprobs

    def _flush(self) -> None:
        """Attribute the gate's weights to the last scored responses (admitted tokens)."""
        if self._pending is None or self.last_weights is None:
            return
        name, lengths = self._pending
        w = self.last_weights
        if len(w) == len(lengths):
            admitted = sum(n for n, wk in zip(lengths, w.tolist(), strict=True) if wk > 0)
            self.counts[(self.step, name)]["admitted"] += admitted
        self._pending = None
        self.last_weights = None


def run_method(args, method: str, paths: dict[str, Path], train_file: Path, root: Path) -> dict[str, Any]:
    import torch

    from graftrl.config import apply_overrides, config_from_dict
    from graftrl.embedded.base import DemoSettings, demo_config
    from graftrl.models.rewards import MathVerifier
    from graftrl.training.trainer import Trainer

    settings = DemoSettings(
        steps=args.warmup + args.steps,
        batch_prompts=args.batch_prompts,
        minibatch_prompts=args.minibatch_prompts,
        n=args.n,
        lr=args.lr,
        max_new_tokens=args.max_new_tokens,
    )
    raw = demo_config(paths, train_file, method, args.seed, settings)
    raw["train"]["micro_batch_size"] = args.micro_batch_size
    raw["logging"] = {"progress": False, "log_samples": 0}
    config = config_from_dict(apply_overrides(raw, list(args.set)))

    rss = C.PeakRSS()
    probe = _Probe()
    wall: list[float] = []
    rss_mb: list[float] = []
    marks = {"t": 0.0}

    def callback(step: int, metrics: dict[str, dict[str, Any]]) -> None:
        now = time.perf_counter()
        wall.append(now - marks["t"])
        rss_mb.append(rss.read_mb())
        probe._flush()
        probe.step = step + 1
        rss.reset()
        marks["t"] = time.perf_counter()

    run_dir = root / method
    with MathVerifier() as verifier:
        trainer = Trainer(config, run_dir, verifier=verifier, step_callback=callback)
        probe.install(trainer)
        probe.step = 0
        torch.manual_seed(args.seed)
        rss.reset()
        marks["t"] = time.perf_counter()
        trainer.train()
    from graftrl.storage.rundir import read_metrics

    rows = read_metrics(run_dir)
    for row in rows:
        row.update({f"probe_{k}": v for k, v in probe.counts[(row["step"], row["model"])].items()})
        row["wall_step"] = wall[row["step"]]
        row["rss_peak_mb"] = rss_mb[row["step"]]
    return {"rows": rows, "rss_resettable": rss.resettable}


def summarize(args, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Medians per (method, model) after warm-up, ratios and predictions."""
    summary: dict[str, Any] = {"per_model": {}, "whole_step": {}, "ratio": {}, "prediction": {}}
    models: list[str] = []
    for method, result in results.items():
        measured = [r for r in result["rows"] if r["step"] >= args.warmup]
        by_model: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in measured:
            by_model[row["model"]].append(row)
        steps = sorted({r["step"] for r in measured})
        walls = [next(r["wall_step"] for r in measured if r["step"] == s) for s in steps]
        summary["whole_step"][method] = {"median_s": C.median(walls), "mean_s": C.mean(walls)}
        for model, rows in by_model.items():
            if model not in models:
                models.append(model)
            entry: dict[str, Any] = {}
            for phase in PHASES:
                values = [r.get(phase) for r in rows]
                if phase == "time_peer_logprob":  # absent on steps with no transfer: costs 0 there
                    values = [v or 0.0 for v in values]
                entry[phase] = C.median(values)
                entry[phase + "_mean"] = C.mean(values)
            # memory_peak_mb: the Trainer's own figure (CUDA allocator peak per step; on CPU the
            # process's RSS high-water mark, reset at each step). rss_step_peak_mb: this script's
            # per-step peak RSS (VmHWM reset before each step), a cross-check on CPU.
            mem = [r.get("memory_peak_mb") for r in rows]
            entry["memory_peak_mb"] = C.median(mem)
            entry["rss_step_peak_mb"] = C.median(r["rss_peak_mb"] for r in rows)
            entry["rss_step_peak_mb_max"] = max(r["rss_peak_mb"] for r in rows)
            for key in ("generated", "scored", "admitted", "grad_tokens"):
                entry["tokens_" + key] = C.mean(r.get("probe_" + key, 0.0) for r in rows)
            entry["peer_responses"] = C.mean(r.get("peer_responses", 0) for r in rows)
            entry["train_tokens"] = C.mean(r.get("train_tokens") for r in rows)
            entry["steps"] = len(rows)
            entry["_sum"] = {
                key: sum(r.get(key) or 0.0 for r in rows)
                for key in ("time_step", "time_peer_logprob", "time_update")
            }
            entry["_sum"].update(
                {
                    key: sum(r.get("probe_" + key, 0.0) for r in rows)
                    for key in ("generated", "scored", "admitted", "grad_tokens")
                }
            )
            summary["per_model"].setdefault(method, {})[model] = entry

    if "grpo" in results and "graft" in results:
        grpo, graft = summary["per_model"]["grpo"], summary["per_model"]["graft"]
        for model in models:
            a, b = grpo[model], graft[model]
            ratio_median = b["time_step"] / a["time_step"] if a["time_step"] else None
            ratio_mean = b["time_step_mean"] / a["time_step_mean"] if a["time_step_mean"] else None
            sa, sb = a["_sum"], b["_sum"]
            # Per-token costs from whole-run totals (a step with no transfer has T_x = 0).
            c_s = sa["time_step"] / sa["generated"] if sa["generated"] else None  # GRPO step s / own token
            c_f = sb["time_peer_logprob"] / sb["scored"] if sb["scored"] else None  # peer fwd s / token
            c_u = (
                sa["time_update"] / sa["grad_tokens"] if sa["grad_tokens"] else None
            )  # GRPO update s / trained token
            t_own = b["tokens_generated"]
            t_x = b["tokens_scored"]
            a_x = b["tokens_admitted"]
            pred = pred_full = None
            if c_s and t_own:
                pred = 1.0 + (t_x / t_own) * ((c_f or 0.0) / c_s)
                pred_full = pred + (a_x / t_own) * ((c_u or 0.0) / c_s)
            summary["ratio"][model] = {"median": ratio_median, "mean": ratio_mean}
            summary["prediction"][model] = {
                "T_own_tokens_per_step": t_own,
                "T_x_tokens_per_step": t_x,
                "admitted_tokens_per_step": a_x,
                "c_s_step_s_per_own_token": c_s,
                "c_f_peer_fwd_s_per_token": c_f,
                "c_u_update_s_per_trained_token": c_u,
                "forward_over_step_cost": (c_f / c_s) if (c_f and c_s) else None,
                "predicted_ratio": pred,
                "predicted_ratio_with_update": pred_full,
            }
        wa, wb = summary["whole_step"]["grpo"]["median_s"], summary["whole_step"]["graft"]["median_s"]
        summary["ratio"]["whole_step"] = {"median": wb / wa if wa else None}
    for per_method in summary["per_model"].values():
        for entry in per_method.values():
            entry.pop("_sum", None)
    return summary


def print_report(args, summary: dict[str, Any], info: dict[str, Any]) -> None:
    rows = []
    for method, per_model in summary["per_model"].items():
        for model, e in per_model.items():
            rows.append(
                [
                    method,
                    model,
                    e["time_rollout"],
                    e["time_reward"],
                    e["time_peer_logprob"],
                    e["time_update"],
                    e["time_step"],
                    e["tokens_generated"],
                    e["tokens_scored"],
                    e["memory_peak_mb"],
                    e["rss_step_peak_mb"],
                ]
            )
    print(
        C.table(
            [
                "method",
                "model",
                "rollout s",
                "reward s",
                "peer logp s",
                "update s",
                "step s",
                "own tok/step",
                "peer tok/step",
                "peak MB (metrics)",
                "RSS peak MB/step",
            ],
            rows,
            title=(
                f"Median per-step phase times after {args.warmup} warm-up steps ({args.steps} measured; "
                f"P={args.batch_prompts}, n={args.n}, max_new_tokens={args.max_new_tokens}, threads={args.threads})"
            ),
        )
    )
    whole = [[m, w["median_s"], w["mean_s"]] for m, w in summary["whole_step"].items()]
    print(
        C.table(["method", "whole step median s", "mean s"], whole, title="Whole Trainer step (both models)")
    )
    if summary["prediction"]:
        prow = []
        for model, p in summary["prediction"].items():
            r = summary["ratio"][model]
            prow.append(
                [
                    model,
                    r["median"],
                    r["mean"],
                    p["T_x_tokens_per_step"] / p["T_own_tokens_per_step"]
                    if p["T_own_tokens_per_step"]
                    else None,
                    p["forward_over_step_cost"],
                    p["predicted_ratio"],
                    p["predicted_ratio_with_update"],
                ]
            )
        print(
            C.table(
                [
                    "model",
                    "GRAFT/GRPO (median)",
                    "(mean)",
                    "T_x/T_own",
                    "c_f/c_s",
                    "predicted",
                    "predicted + peer update",
                ],
                prow,
                title="GRAFT / GRPO step-time ratio, measured vs predicted 1 + (T_x/T_own)(c_f/c_s)",
            )
        )
        print(f"whole-step ratio (median): {C.fmt(summary['ratio']['whole_step']['median'])}")
    print(
        "peak MB (metrics): the Trainer's memory_peak_mb (CUDA: allocator peak of the step; CPU: the "
        "process's RSS high-water mark of the step; '-' when the Trainer does not log it). "
        f"RSS peak MB/step: this process's peak RSS within each step "
        f"({'VmHWM reset per step' if info.get('rss_resettable') else 'NOT resettable here: lifetime peak'})."
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    C.set_threads(args.threads)
    C.quiet_hf()
    note = C.contention_note(args.threads)
    info = C.machine_info()
    paths = C.embedded_paths(args.cache_dir)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    with tempfile.TemporaryDirectory(prefix="graftrl-bench-") as tmp:
        root = Path(args.out_dir) if args.out_dir else Path(tmp)
        train_file = C.embedded_train_file(root / "data")
        results = {}
        for method in methods:
            start = time.perf_counter()
            results[method] = run_method(args, method, paths, train_file, root)
            print(
                f"{method}: {args.warmup + args.steps} steps in {time.perf_counter() - start:.1f}s",
                flush=True,
            )
    summary = summarize(args, results)
    info["rss_resettable"] = all(r["rss_resettable"] for r in results.values())
    if note:
        print(note)
    print_report(args, summary, info)
    payload = {"args": vars(args), "machine": info, "contention": note, "summary": summary}
    payload["rows"] = {m: r["rows"] for m, r in results.items()}
    C.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
