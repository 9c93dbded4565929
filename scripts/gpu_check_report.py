"""The GPU check's summary (scripts/gpu_check.sh's last stage): summary.md and summary.json from
the stages' table, the environment check, the cuda tier's JUnit XML and figures, and the
benchmarks' JSON files in the output folder.

    python scripts/gpu_check_report.py --out DIR --stages STAGES.tsv [--junit F] [--env F] [--title T]

Standard library only; exit status 1 when a stage neither passed nor was skipped.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, (bool, int)):
        return str(value)
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}f}"
    return str(value)


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return [*lines, ""]


def _measured(result: dict[str, Any] | None, key: str) -> Any:
    """A memory_vs_length cell: the figure, OOM, or - (not measured)."""
    if result is None:
        return None
    return "OOM" if result.get("oom") else result.get(key)


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _junit(path: Path | None) -> list[list[Any]]:
    if path is None or not path.exists():
        return []
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = child.tag + ": " + (child.get("message") or "").splitlines()[0][:160]
            elif child.tag == "skipped":
                outcome = "skipped: " + (child.get("message") or "")[:160]
        rows.append([case.get("name"), outcome, float(case.get("time") or 0)])
    return rows


def _cuda_tier_rows(tier: dict[str, Any]) -> list[str]:
    tests = tier.get("tests", {})
    lines: list[str] = []
    memory = [(k, v) for k, v in tests.items() if k.startswith("memory_estimate_")]
    if memory:
        lines += ["Memory estimate (`graftrl estimate-memory`) against the measured step peak, GiB:", ""]
        lines += _table(
            [
                "run",
                "states",
                "copy",
                "acts",
                "logits",
                "HF gen",
                "estimate",
                "measured",
                "measured / estimate",
            ],
            [
                [
                    k.removeprefix("memory_estimate_"),
                    *(
                        v["estimate_gib"][p]
                        for p in ("model_states", "compute_copy", "activations", "logits", "generation")
                    ),
                    v["estimate_gib"]["peak"],
                    v["measured_gib"],
                    v.get("ratio"),
                ]
                for k, v in memory
            ],
        )
    paths = tests.get("logprob_paths")
    if paths:
        lines += [
            f"Log-prob paths against the plain one ({paths['rows']} rows, responses {paths['response_widths']}, "
            f"chunk {paths['chunk']}, vocab {paths['vocab']}):",
            "",
        ]
        lines += _table(
            [
                "setting",
                "peak MB",
                "max abs log-prob diff",
                "grad rel error (whole)",
                "grad rel error (worst parameter)",
            ],
            [
                [
                    k,
                    v.get("peak_mb"),
                    v.get("logp_max_abs_diff"),
                    (v.get("grad_rel_err") or {}).get("whole"),
                    (v.get("grad_rel_err") or {}).get("worst"),
                ]
                for k, v in paths["results"].items()
            ],
        )
    fsdp = tests.get("fsdp2_one_rank")
    if fsdp:
        lines += ["FSDP2 on one rank against autocast:", ""]
        lines += _table(
            [
                "log-prob diff",
                "loss (plain, FSDP)",
                "grad rel err",
                "weight diff after steps",
                "restored exactly",
                "continued diff",
            ],
            [
                [
                    fsdp["logp_max_abs_diff"],
                    ", ".join(_fmt(x, 5) for x in fsdp["loss"]),
                    fsdp["grad_rel_err"]["whole"],
                    fsdp["weight_max_abs_diff_after_steps"],
                    fsdp["restored_exact"],
                    fsdp["continued_max_abs_diff"],
                ]
            ],
        )
    steps = [(k, v) for k, v in tests.items() if k.startswith("bf16_")]
    if steps:
        lines += ["bf16 steps of the two models (per step):", ""]
        rows = []
        for k, v in steps:
            for model, per_step in v["steps"].items():
                for i, m in enumerate(per_step):
                    rows.append(
                        [
                            k.removeprefix("bf16_"),
                            model,
                            i,
                            m.get("time_rollout"),
                            m.get("time_update"),
                            m.get("time_step"),
                            m.get("memory_peak_mb"),
                            m.get("train_tokens"),
                            m.get("peer_admitted"),
                            m.get("loss"),
                        ]
                    )
        lines += _table(
            [
                "method",
                "model",
                "step",
                "rollout s",
                "update s",
                "step s",
                "peak MB",
                "train tokens",
                "peer admitted",
                "loss",
            ],
            rows,
        )
    logprobs, distribution = tests.get("compiled_decode_logprobs"), tests.get("compiled_decode_distribution")
    if logprobs:
        timing = logprobs.get("timing", {})
        lines += [
            f"Compiled decode (tests/test_cuda_decode.py): {logprobs['tokens']} tokens, |recorded - eager "
            f"re-score| max {_fmt(logprobs['max_error'])} (after new weights {_fmt(logprobs['max_error_after_update'])}); "
            f"{timing.get('rows')} rows x {timing.get('steps')} steps: {_fmt(logprobs['ms_per_step'])} ms per decode "
            f"step, CUDA graph {timing.get('graph')}; first call's compile {_fmt(logprobs['first_call'].get('compile_s'))} s.",
            "",
        ]
    if distribution:
        lines += [
            f"Compiled decode distribution at T = {_fmt(distribution['temperature'])} ({distribution['tokens']:.0f} "
            f"tokens): PIT KS p {_fmt(distribution['pit_p'])}, eager's own {_fmt(distribution['eager_pit_p'])}, "
            f"two-sample p {_fmt(distribution['two_sample_p'])}, wrong-temperature control p "
            f"{_fmt(distribution['control_pit_p'])} (D {_fmt(distribution['control_statistic'])}).",
            "",
        ]
    resume = tests.get("exact_resume")
    if resume:
        lines += [
            f"Exact resume: start step {resume['start_step']}, max weight diff {resume['weight_max_abs_diff']}, "
            f"{resume['tensors_differing']} tensors differing.",
            "",
        ]
    return lines


def _decode_rows(decode: dict[str, Any] | None) -> list[str]:
    """benchmarks/decode_speed.py: ms per decode step per sampler and cell, the GRAFT step."""
    if not decode:
        return []
    lines = ["`benchmarks/decode_speed.py` (ms per step = timed call / tokens per row; compile apart):", ""]
    lines += _table(
        ["sampler", "rows", "new tokens", "ms/step", "decode ms/step", "compile s", "CUDA graph", "error"],
        [
            [
                c["engine"], c["rows"], c["new_tokens"], c.get("ms_per_step"), c.get("decode_ms_per_step"),
                c.get("compile_s_first_call"), c.get("cuda_graph"), c.get("error", ""),
            ]
            for c in decode.get("cells", [])
        ],
    )  # fmt: skip
    for step in decode.get("graft_steps", []):
        walls = ", ".join(_fmt(s) for s in step.get("step_wall_s", []))
        lines += [f"GRAFT step (compile {step.get('compile')}): {step.get('error') or f'wall {walls} s'}", ""]
    lines += [f"- {note}" for note in decode.get("notes", [])]
    lines += [f"- skipped (budget): {s}" for s in decode.get("skipped", [])]
    return lines + ([""] if decode.get("notes") or decode.get("skipped") else [])


def report(out: Path, stages_file: Path, junit: Path | None, env_file: Path | None, title: str) -> int:
    with stages_file.open() as handle:
        stages = [
            {
                "stage": r[0],
                "status": r[1],
                "rc": r[2],
                "seconds": float(r[3]),
                "limit_s": r[4],
                "command": r[5],
            }
            for r in csv.reader(handle, delimiter="\t")
        ]
    env = _load(env_file) if env_file else None
    tier = _load(out / "cuda_tier.json")
    benchmarks = {
        name: _load(out / f"{name}.json")
        for name in ("decode", "gpu_step", "memory_vs_length", "fsdp_scaling")
    }
    tests = _junit(junit)
    lines = [f"# {title}", ""]
    if env:
        info = env.get("info", {})
        lines += [
            f"python {info.get('python')}, torch {info.get('torch')}, transformers {info.get('transformers')}, "
            f"GPU {info.get('gpu')}, CUDA {info.get('cuda')}",
            "",
        ]
    lines += _table(
        ["stage", "status", "rc", "seconds", "limit s"],
        [[s["stage"], s["status"], s["rc"], s["seconds"], s["limit_s"]] for s in stages],
    )
    if env:
        failed = [c for c in env.get("checks", []) if not c["ok"]]
        lines += [f"env checks: {len(env.get('checks', [])) - len(failed)} ok, {len(failed)} failed", ""]
        lines += [f"- FAIL {c['check']}: {c['detail']}" for c in failed] + ([""] if failed else [])
    if tests:
        lines += ["CUDA tier (`pytest -m cuda tests/test_cuda.py tests/test_cuda_decode.py`):", ""]
        lines += _table(["test", "outcome", "seconds"], tests)
    if tier:
        lines += [f"device: {tier.get('device')}; size: {tier.get('size')}", ""]
        lines += _cuda_tier_rows(tier)
    lines += _decode_rows(benchmarks["decode"])
    gpu_step = benchmarks["gpu_step"]
    if gpu_step:
        lines += ["`benchmarks/gpu_step.py` (medians per step):", ""]
        lines += _table(
            [
                "engine",
                "rollout s",
                "update s",
                "step s",
                "wall step s",
                "tokens/step",
                "rollout tok/s",
                "update tok/s",
                "log-prob tok/s",
                "CUDA max alloc MB/step",
            ],
            [
                [
                    name,
                    r.get("time_rollout"),
                    r.get("time_update"),
                    r.get("time_step"),
                    r.get("wall_step_s"),
                    r.get("generated_tokens"),
                    r.get("rollout_tokens_per_s"),
                    r.get("update_tokens_per_s"),
                    r.get("logprob_tokens_per_s"),
                    r.get("cuda_max_allocated_mb_per_step"),
                ]
                for name, r in gpu_step.get("results", {}).items()
            ],
        )
    memory = benchmarks["memory_vs_length"]
    if memory:
        settings = list(dict.fromkeys(r["setting"] for r in memory["results"]))
        by = {(r["setting"], r["length"]): r for r in memory["results"]}
        lengths = sorted({r["length"] for r in memory["results"]})
        lines += [
            f"`benchmarks/memory_vs_length.py` ({memory['parameters'] / 1e6:.1f}M params): peak MB / seconds",
            "",
        ]
        lines += _table(
            ["L", *[f"{s} MB" for s in settings], *[f"{s} s" for s in settings]],
            [
                [
                    n,
                    *[_measured(by.get((s, n)), "peak_mb") for s in settings],
                    *[_measured(by.get((s, n)), "seconds") for s in settings],
                ]
                for n in lengths
            ],
        )
    fsdp = benchmarks["fsdp_scaling"]
    if fsdp:
        lines += [f"`benchmarks/fsdp_scaling.py` ({fsdp.get('title', '')}):", ""]
        lines += _table(fsdp["headers"], fsdp["rows"])
    markdown = "\n".join(lines)
    (out / "summary.md").write_text(markdown + "\n")
    summary = {
        "title": title,
        "stages": stages,
        "env": env,
        "tests": tests,
        "cuda_tier": tier,
        "benchmarks": benchmarks,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(markdown)
    bad = [s["stage"] for s in stages if s["status"] not in ("passed", "skipped")]
    print(
        f"\nGPU check: {len(stages) - len(bad)} of {len(stages)} stages passed or skipped"
        + (f"; not: {', '.join(bad)}" if bad else "")
    )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--stages", required=True, type=Path)
    parser.add_argument("--junit", type=Path, default=None)
    parser.add_argument("--env", type=Path, default=None)
    parser.add_argument("--title", default="graftrl GPU check")
    args = parser.parse_args(argv)
    return report(args.out, args.stages, args.junit, args.env, args.title)


if __name__ == "__main__":
    sys.exit(main())
