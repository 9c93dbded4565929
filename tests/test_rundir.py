"""The run folder's one owner (graftrl.storage.rundir): layout and JSONL logs; the declared keys (graftrl.storage.log_keys)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graftrl.cli import app
from graftrl.config import config_from_dict
from graftrl.errors import UserError
from graftrl.storage.data import load_problems
from graftrl.storage.log_keys import (
    COMPATIBILITY_KEYS,
    METRIC_KEYS,
    SAMPLE_KEYS,
    VALIDATION_KEYS,
    LogKey,
    find_key,
    keys_markdown,
    undeclared_keys,
)
from graftrl.storage.metrics import MetricsLogger
from graftrl.storage.rundir import ExperimentDir, RunDir, RunLogError, append_jsonl, read_jsonl, read_metrics
from graftrl.training.log_schema import metric_keys
from graftrl.training.trainer import Trainer

FIXTURES = Path(__file__).parent / "fixtures"
DOCS = Path(__file__).parents[1] / "docs" / "metrics.md"


def test_the_layout_keeps_its_names(tmp_path):
    """Run folders written before this module keep working: the names are the on-disk contract."""
    run = RunDir(str(tmp_path))
    assert run.root == tmp_path
    named = {
        run.config: "config.yaml",
        run.metrics: "metrics.jsonl",
        run.samples: "samples.jsonl",
        run.compatibility: "compatibility.jsonl",
        run.validation: "validation.jsonl",
        run.rescues: "rescues.jsonl",
        run.checkpoints: "checkpoints",
        run.checkpoint(3): "checkpoints/step_000003",
        run.best: "best",
        run.best_index: "best/best.json",
        run.store: "store",
        run.tensorboard: "tensorboard",
        run.analysis: "analysis",
        run.evaluation(best=False): "eval",
        run.evaluation(best=True): "eval-best",
        run.lock: "run.lock",
        run.done: "done.json",
    }
    out = ExperimentDir(tmp_path)
    named |= {
        out.train_data: "data/train.jsonl",
        out.heldout_data: "data/heldout.jsonl",
        out.run("graft", 2).root: "runs/graft-seed2",
        out.run("warm-start").root: "runs/warm-start",
        out.results: "results.json",
        out.results_csv: "results.csv",
        out.report: "report.md",
    }
    for path, name in named.items():
        assert path.relative_to(tmp_path).as_posix() == name
    assert run.logs == (run.metrics, run.samples, run.compatibility, run.validation, run.rescues)
    assert not run.holds_run() and not run.is_run()
    append_jsonl(run.metrics, {"step": 0})
    run.config.write_text("seed: 1\n")
    assert run.holds_run() and run.is_run()


def test_append_and_read_skip_only_a_torn_last_line(tmp_path):
    path = tmp_path / "compatibility.jsonl"
    append_jsonl(path, {"step": 0, "s": [1.0]})
    append_jsonl(path, [{"step": 1}, {"step": 2}])
    append_jsonl(path, [])
    assert path.read_text() == '{"step": 0, "s": [1.0]}\n{"step": 1}\n{"step": 2}\n'
    with path.open("a") as handle:
        handle.write('{"step": 3, "s"')  # a kill mid-append
    notes: list[str] = []
    assert [r["step"] for r in read_jsonl(path, on_torn=notes.append)] == [0, 1, 2]
    assert notes == ["compatibility.jsonl line 4: incomplete last line skipped (interrupted write)"]

    path.write_text('{"step": 0}\n{"st\n{"step": 1}\n')
    with pytest.raises(RunLogError, match=r"compatibility\.jsonl line 2: not valid JSON") as raised:
        read_jsonl(path)
    # one line for the CLI (a UserError), and still what json readers catch
    assert isinstance(raised.value, UserError) and isinstance(raised.value, json.JSONDecodeError)
    path.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(RunLogError, match="line 2: expected a JSON object"):
        read_jsonl(path)


def test_truncate_logs_cuts_every_log_and_removes_stale_temps(tmp_path):
    run = RunDir(tmp_path)
    for log in run.logs:
        append_jsonl(log, [{"step": s, "model": "a"} for s in range(4)])
    with run.samples.open("a") as handle:
        handle.write('{"step": 4, "mo')
    stale = tmp_path / ".config.yaml.tmp-abc"
    stale.write_text("partial")
    unrelated = tmp_path / "notes.jsonl"
    append_jsonl(unrelated, {"step": 9})

    assert run.truncate_logs(1) == {run.samples: 1}
    for log in run.logs:
        assert [r["step"] for r in read_jsonl(log)] == [0, 1]
        discarded = log.with_name(log.stem + ".discarded.jsonl")
        expected = ['{"step": 2, "model": "a"}', '{"step": 3, "model": "a"}']
        assert discarded.read_text().splitlines() == expected + (
            ['{"step": 4, "mo'] if log == run.samples else []
        )
    assert not stale.exists() and read_jsonl(unrelated) == [{"step": 9}]
    assert run.truncate_logs(1) == {}  # nothing more to move
    assert read_metrics(tmp_path) == [{"step": 0, "model": "a"}, {"step": 1, "model": "a"}]


def test_declared_keys_match_names_and_patterns():
    assert find_key("reward_mean").name == "reward_mean"
    assert find_key("family_reward/add").name == "family_reward/<family>"
    assert find_key("candidates/gpt2-large", metric_keys()).name == "candidates/<source>"  # GRAFT's
    assert find_key("family_reward/") is None  # a placeholder stands for a non-empty name
    assert find_key("reward_mean_typo") is None
    row = {"step": 0, "model": "a", "omega/b": 1.0, "new_thing": 2}
    assert undeclared_keys([row], metric_keys()) == ["new_thing"]
    # HACPO declares omega/<source> (training.log_schema), not the trainer (METRIC_KEYS)
    assert undeclared_keys([row]) == ["new_thing", "omega/b"]
    for declared in (METRIC_KEYS, VALIDATION_KEYS, COMPATIBILITY_KEYS, SAMPLE_KEYS):
        names = [key.name for key in declared]
        assert len(names) == len(set(names)), "a key declared twice"
        assert all(key.meaning and key.unit and key.group for key in declared)
    assert LogKey("pass_at_1/<benchmark>", "m", "u", "g").matches("pass_at_1/MATH500")


def test_docs_metrics_md_is_generated_from_the_schema():
    assert DOCS.read_text() == keys_markdown(metric_keys()), (
        "regenerate: graftrl metrics-reference --markdown > docs/metrics.md"
    )
    result = CliRunner().invoke(app, ["metrics-reference", "--markdown"])
    assert result.exit_code == 0 and result.output == keys_markdown(metric_keys())
    table = CliRunner().invoke(app, ["metrics-reference"], env={"COLUMNS": "200"})
    assert (
        table.exit_code == 0
        and "complementarity/<peer>" in table.output
        and "validation.jsonl" in table.output
    )


def test_sinks_carry_the_schema(tmp_path, monkeypatch):
    """TensorBoard gets the key table as text, W&B the declared summaries; both get every scalar."""
    calls: dict[str, list] = {"text": [], "scalar": [], "define": [], "log": []}

    class Writer:
        def __init__(self, logdir: str) -> None:
            calls["logdir"] = logdir

        def add_text(self, tag, text, step):
            calls["text"].append((tag, text, step))

        def add_scalar(self, tag, value, step):
            calls["scalar"].append((tag, value, step))

        def close(self):
            pass

    class Run:
        def define_metric(self, name, summary):
            calls["define"].append((name, summary))

        def log(self, values, step):
            calls["log"].append((values, step))

        def finish(self):
            pass

    tensorboard = types.ModuleType("torch.utils.tensorboard")
    tensorboard.SummaryWriter = Writer  # type: ignore[attr-defined]
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kwargs: Run()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tensorboard)
    monkeypatch.setitem(sys.modules, "wandb", wandb)

    logger = MetricsLogger(tmp_path, tensorboard=True, wandb=True, keys=metric_keys())
    logger.log({"step": 2, "model": "a", "method": "graft", "reward_mean": 0.5, "family_reward/add": 1.0})
    logger.log(
        {"step": 3, "model": "a", "reward_mean": 0.6, "time_step": 2.0, "loss": 0.1, "memory_peak_mb": 9}
    )
    logger.close()
    assert calls["logdir"] == str(RunDir(tmp_path).tensorboard)
    assert calls["text"] == [("graftrl/metric_keys", keys_markdown(metric_keys()), 0)]
    assert calls["scalar"][:2] == [("a/reward_mean", 0.5, 2), ("a/family_reward/add", 1.0, 2)]
    assert calls["log"][0] == ({"a/reward_mean": 0.5, "a/family_reward/add": 1.0}, 2)
    assert len(calls["scalar"]) == 6 and calls["log"][1][1] == 3
    # each scalar's declared summary, once, by its exact name; W&B's default (the last value) is kept
    assert calls["define"] == [
        ("a/reward_mean", "max"),
        ("a/family_reward/add", "max"),
        ("a/time_step", "mean"),
        ("a/memory_peak_mb", "max"),
    ]
    assert [row["step"] for row in read_metrics(tmp_path)] == [2, 3]


# ----- every key a run logs is declared -------------------------------------------------------------


class PatternRewards:
    """Size-agnostic rewards: policy k (its k-th call in a step, k = call % 2) fails prompt k entirely
    and has mixed groups elsewhere, so every exchange direction has a candidate."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def score(self, responses, answers):
        who = self.calls % 2
        self.calls += 1
        return [0.0 if i // self.n == who else float((i + i // self.n) % 2) for i in range(len(responses))]

    def close(self) -> None:
        pass


def short_run(paths, tmp_path, method: str, **sections) -> RunDir:
    problems = load_problems(FIXTURES / "math_small.jsonl")
    families = [
        p.__class__(p.id, p.problem, p.answer, family=("even", "odd")[i % 2]) for i, p in enumerate(problems)
    ]
    raw = {
        "method": method,
        "seed": 5,
        "policies": [
            {"name": "llama", "path": str(paths["llama"]), "template": "{problem}="},
            {"name": "gpt2", "path": str(paths["gpt2"]), "template": "Q: {problem}\nA: "},
        ],
        "data": {"train": str(FIXTURES / "math_small.jsonl"), "prompt_suffix": None},
        "rollout": {"n": 4, "max_new_tokens": 6},
        "train": {"steps": 1, "batch_prompts": 4, "minibatch_prompts": 2, "micro_batch_size": 8},
        "optim": {"lr": 1e-2},
        "logging": {"progress": False, "log_samples": 1},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    run = RunDir(tmp_path / method)
    Trainer(config_from_dict(raw), run.root, problems=families, verifier=PatternRewards(4)).train()
    return run


@pytest.mark.parametrize("method", ["graft", "grpo", "hacpo", "luffy", "pooling", "sgt"])
def test_every_logged_key_is_declared(tiny_checkpoints, tmp_path, method):
    """One real step of each method (GRAFT with validation and truncated IS, GRPO with dynamic
    sampling): every key of every log is declared in graftrl.storage.log_keys (docs/metrics.md)."""
    sections: dict = {}
    if method == "graft":
        sections = {
            "rollout": {"tis_cap": 2.0},
            "validation": {
                "files": {"small": str(FIXTURES / "math_small.jsonl")},
                "samples": 1,
                "max_problems": 2,
            },
        }
    if method == "grpo":
        sections = {"rollout": {"dynamic_sampling": True, "max_sampling_rounds": 2}}
    run = short_run(tiny_checkpoints, tmp_path, method, **sections)
    metrics = read_metrics(run.root)
    assert len(metrics) == 2
    assert undeclared_keys(metrics, metric_keys()) == []
    assert undeclared_keys(read_jsonl(run.samples), SAMPLE_KEYS) == []
    assert all(any(key.startswith("family_reward/") for key in row) for row in metrics)
    if method == "graft":
        assert all(row["peer_responses"] > 0 and "tis_weight_mean" in row for row in metrics)
        assert undeclared_keys(read_jsonl(run.compatibility), COMPATIBILITY_KEYS) == []
        assert [row["model"] for row in read_jsonl(run.validation)] == ["llama", "gpt2"]
        assert undeclared_keys(read_jsonl(run.validation), VALIDATION_KEYS) == []
    if method == "grpo":
        assert all("sampling_rounds" in row for row in metrics)


def test_no_other_module_names_a_run_folder_file():
    """The layout lives in rundir.py: no other module spells a run-folder file name."""
    import ast

    names = {
        "config.yaml",
        "metrics.jsonl",
        "samples.jsonl",
        "compatibility.jsonl",
        "validation.jsonl",
        "checkpoints",
        "run.lock",
        "trainer_state.json",
        "method_state.json",
        "best.json",
        "done.json",
        "results.json",
        "results.csv",
        "report.md",
        "train.jsonl",
        "heldout.jsonl",
    }
    package = Path(__file__).parents[1] / "src" / "graftrl"
    found = [
        f"{path.relative_to(package)}:{node.lineno}: {node.value!r}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "rundir.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert found == []
