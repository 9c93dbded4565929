"""The evaluation report's files: ``eval.json``, ``eval.md`` (the paper's table layout) and ``eval.png``.

``markdown_table`` lays a report out as the paper does (rows = models, columns = benchmarks + Avg.,
cells "mean ± std" in percent, then the aggregate pass@k table); ``plot_report`` draws pass@1 bars
per benchmark with the std over runs as error bars; ``write_report`` writes all three. The report
itself is :func:`graftrl.evaluation.evaluate.evaluate_targets`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def verification_summary(stats: Mapping[str, Any]) -> str:
    rate = stats.get("answers_per_s")
    return (
        f"verification: {int(stats.get('answers', 0))} answers in {stats.get('seconds', 0.0):.2f} s"
        + (f" ({rate:,.0f} answers/s" if rate else " (")
        + f", {stats.get('workers')} worker(s), {int(stats.get('verified', 0))} sent to math_verify, "
        f"{int(stats.get('timeouts', 0))} timeouts scored 0, {int(stats.get('errors', 0))} errors)"
    )


def _cell(stat: Mapping[str, Any]) -> str:
    return f"{100 * stat['mean']:.2f} ± {100 * stat['std']:.2f}"


def markdown_table(report: Mapping[str, Any]) -> str:
    """The paper's layout: rows = models, columns = benchmarks + Avg., cells "mean ± std" (percent)."""
    names = [b["name"] for b in report["benchmarks"]]
    protocol = report["protocol"]
    lines = [
        f"pass@1 (%) with {protocol['samples']} samples per problem at temperature {protocol['temperature']}, "
        f"top-p {protocol['top_p']}, max {protocol['max_new_tokens']} new tokens; mean ± std over "
        f"{protocol['runs']} run(s).",
        "",
        "| Model | " + " | ".join(names) + " | Avg. |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for label, model in report["models"].items():
        cells = [_cell(model["benchmarks"][n]["pass_at_1"]) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {_cell(model['aggregate']['pass_at_1'])} |")
    ks = [str(k) for k in protocol["ks"]]
    lines += [
        "",
        "pass@k (%), unbiased estimator, averaged over benchmarks (Avg.).",
        "",
        "| Model | " + " | ".join(f"pass@{k}" for k in ks) + " |",
        "|---|" + "---|" * len(ks),
    ]
    for label, model in report["models"].items():
        cells = [_cell(model["aggregate"]["pass_at_k"][k]) for k in ks]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if report.get("verification"):
        lines += ["", verification_summary(report["verification"])]
    return "\n".join(lines) + "\n"


def plot_report(report: Mapping[str, Any], path: str | Path) -> Path:
    """Grouped bars: pass@1 per benchmark (and Avg.) for every model, std over runs as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [b["name"] for b in report["benchmarks"]]
    columns = [*names, "Avg."]
    models = list(report["models"])
    width = 0.8 / max(len(models), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 + len(columns) * (0.5 + 0.3 * len(models))), 3.8))
    top = 0.0
    for j, label in enumerate(models):
        model = report["models"][label]
        stats = [model["benchmarks"][n]["pass_at_1"] for n in names] + [model["aggregate"]["pass_at_1"]]
        xs = [i + j * width for i in range(len(columns))]
        bars = ax.bar(
            xs,
            [100 * s["mean"] for s in stats],
            width,
            yerr=[100 * s["std"] for s in stats],
            capsize=3,
            color=f"C{j}",
            label=label,
        )
        ax.bar_label(bars, labels=[f"{100 * s['mean']:.1f}" for s in stats], fontsize=6, padding=2)
        top = max([top, *(100 * (s["mean"] + s["std"]) for s in stats)])
    ax.set_ylim(0, max(1.0, min(100.0, top * 1.15)) if top < 100 else top * 1.05)
    ax.set_xticks([i + width * (len(models) - 1) / 2 for i in range(len(columns))], columns)
    ax.set_ylabel("pass@1 (%)")
    ax.set_title(f"mean ± std over {report['protocol']['runs']} run(s)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(report: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write eval.json, eval.md and eval.png into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "eval.json", "markdown": out / "eval.md", "plot": out / "eval.png"}
    paths["json"].write_text(json.dumps(report, indent=1) + "\n")
    paths["markdown"].write_text(markdown_table(report))
    plot_report(report, paths["plot"])
    return paths
