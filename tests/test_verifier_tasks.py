"""Any verifiable task end to end: verl's data and scorer train, probe and evaluate unchanged; a
training step whose rollouts hold the hostile programs completes with every other reward right;
analyze counts the failures by class."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from conftest import make_config
from typer.testing import CliRunner

from graftrl.cli import app
from graftrl.config import config_from_dict
from graftrl.training.trainer import Trainer

# A reward function written as verl's documentation shows one (`custom_reward_function.path` and
# `.name`): verl calls compute_score(data_source, solution_str, ground_truth, extra_info).
VERL_SCORER = '''
import zlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """For these untrained models, a hash of the response stands in for a real check (so groups
    are mixed); it also checks that verl's arguments arrive as verl passes them."""
    assert data_source == "openai/gsm8k" and isinstance(extra_info, dict) and extra_info["split"] == "train"
    assert isinstance(ground_truth, str)
    if zlib.crc32(solution_str.encode()) % 3 == 0:
        return {"score": 1.0, "acc": True}
    return 0.0
'''


def verl_parquet(path: Path, count: int) -> Path:
    """Rows as verl's gsm8k preprocessing writes them."""
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{i}+{i + 1}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
            "extra_info": {
                "split": "train",
                "index": i,
                "answer": str(2 * i + 1),
                "question": f"{i}+{i + 1}",
            },
        }
        for i in range(count)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_verl_data_and_scorer_train_probe_and_evaluate(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = verl_parquet(tmp_path / "gsm8k_train.parquet", 12)
    (tmp_path / "my_reward.py").write_text(VERL_SCORER)
    raw = make_config(tiny_checkpoints)
    raw["data"] = {"train": str(data)}
    raw["reward"] = {"kind": "function", "function": {"path": "my_reward.py:compute_score"}}
    config = tmp_path / "verl.yaml"
    config.write_text(json.dumps(raw))
    runner = CliRunner()

    trained = runner.invoke(app, ["train", str(config), "--out", "run"])
    assert trained.exit_code == 0, trained.output
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    assert any(0.0 < r["reward_mean"] < 1.0 for r in rows)  # the scorer's 1.0s and 0.0s both arrived
    assert all(r.get("failures/wrong", 0) > 0 for r in rows)  # the scorer's 0s

    probed = runner.invoke(app, ["probe", str(config), "--prompts", "4", "--out", "probe"])
    assert probed.exit_code == 0, probed.output
    assert json.loads((tmp_path / "probe" / "probe.json").read_text())["steps"] >= 1

    evaluated = runner.invoke(app, ["eval", "run", "-b", f"gsm8k={data}", "--runs", "1", "--samples", "2"])
    assert evaluated.exit_code == 0, evaluated.output
    report = json.loads(next((tmp_path / "run").rglob("eval.json")).read_text())
    assert "gsm8k" in json.dumps(report)


def test_a_step_with_hostile_programs_completes_and_scores_the_rest_right(
    tiny_checkpoints, tmp_path, monkeypatch
):
    """The policies' sampled texts are replaced by fixed programs (this test alone): prompt 0 gets
    the hostile set, the others honest programs whose rewards are known."""
    from test_sandbox_hostile import ESCAPED, SECRET

    tests = [
        "assert add(1, 2) == 3",
        "assert add(2, 2) == 4",
        "assert add(-1, 1) == 0",
        "assert add(5, 0) == 5",
    ]
    train = tmp_path / "code.jsonl"
    train.write_text(
        "".join(json.dumps({"id": f"p{i}", "problem": f"add {i}", "tests": tests}) + "\n" for i in range(4))
    )
    hostile = [
        "import os\nwhile True:\n    os.fork()",
        f"open({ESCAPED!r}, 'w').write('x')\ndef add(a, b):\n    return -1",
        "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\ndef add(a, b): return a + b",
        "import os, signal\nos.kill(-1, signal.SIGKILL)",
    ]
    honest = {
        1: ["def add(a, b):\n    return a + b"] * 4,  # 1.0
        2: ["def add(a, b):\n    return a + b if a > 1 else 0"] * 2
        + ["def add(a, b):\n    return a - b"] * 2,
        3: [
            "```python\ndef add(a, b):\n    return abs(a) + b\n```",
            "",
            "def add(a, b) return",
            "def add(a, b): return 3",
        ],
    }
    expected = {1: [1.0] * 4, 2: [0.75, 0.75, 0.25, 0.25], 3: [0.75, 0.0, 0.0, 0.25]}
    monkeypatch.setenv("GRAFTRL_SECRET", SECRET)
    raw = make_config(tiny_checkpoints, steps=1)
    raw["data"] = {"train": str(train)}
    raw["reward"] = {"kind": "code", "workers": 2, "code": {"test_timeout_s": 2, "cpu_s": 3}}
    trainer = Trainer(config_from_dict(raw), tmp_path / "run")
    seen: list[tuple[list[str], list[float]]] = []
    try:
        for policy in trainer.policies:
            decode = policy.decode_responses

            def fixed(*args, decode=decode, **kwargs):
                texts = decode(*args, **kwargs)
                return [_program_for(i, len(texts), hostile, honest) for i in range(len(texts))]

            policy.decode_responses = fixed  # type: ignore[method-assign]
        verifier = trainer.verifier
        rewards = verifier.rewards

        def recorded(texts, problems):
            out = rewards(texts, problems)
            seen.append(([p.id for p in problems], out))
            return out

        verifier.rewards = recorded  # type: ignore[method-assign]
        trainer.train()
    finally:
        trainer.close()
    assert seen, "the step scored nothing"
    for ids, out in seen[:2]:  # each policy's own rollouts
        by_prompt: dict[str, list[float]] = {}
        for pid, reward in zip(ids, out, strict=True):
            by_prompt.setdefault(pid, []).append(reward)
        order = list(dict.fromkeys(ids))
        assert by_prompt[order[0]] == [0.0] * 4
        for slot in (1, 2, 3):
            assert by_prompt[order[slot]] == expected[slot], (slot, by_prompt)
    assert not Path(ESCAPED).exists()


def _program_for(row: int, rows: int, hostile: list[str], honest: dict[int, list[str]]) -> str:
    n = 4
    prompt, sample = divmod(row, n)
    return hostile[sample] if prompt == 0 else honest[prompt][sample]


def test_analyze_counts_failures_by_class(tiny_checkpoints, tmp_path):
    from graftrl.reporting.analysis_report import write_analysis
    from graftrl.reporting.analyze import analyze_run

    tests = ["assert f() == 1"]
    train = tmp_path / "code.jsonl"
    train.write_text(
        "".join(json.dumps({"id": f"p{i}", "problem": "f", "tests": tests}) + "\n" for i in range(4))
    )
    raw = make_config(tiny_checkpoints, steps=1)
    raw["data"] = {"train": str(train)}
    raw["reward"] = {"kind": "code"}
    trainer = Trainer(config_from_dict(raw), tmp_path / "run")
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    counted = {key: value for row in rows for key, value in row.items() if key.startswith("failures/")}
    assert counted and set(counted) <= {
        "failures/syntax_error",
        "failures/no_code",
        "failures/crash",
        "failures/tests_failed",
    }
    report = write_analysis(analyze_run(tmp_path / "run"), tmp_path / "analysis").report.read_text()
    assert "## Failures by class" in report
    total = sum(int(row.get(key, 0)) for row in rows for key in counted)
    assert total == 2 * 4 * 4  # 2 policies x 4 prompts x n = 4, none of them a passing program
