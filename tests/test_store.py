"""Trajectory store: round trip, atomic writes, damage reports, JSONL import, rollout rows."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import FIXTURES, make_row, step_rows
from typer.testing import CliRunner

import graftrl.storage
from graftrl.cli import app
from graftrl.core import grpo_advantages
from graftrl.models.policy import Policy
from graftrl.models.rollout import HFRolloutEngine, SamplingParams
from graftrl.storage.data import MathProblem
from graftrl.storage.records import TrajectoryRecord
from graftrl.storage.store import (
    SCHEMA,
    SCHEMA_VERSION,
    StoredTrajectory,
    StoreError,
    TrajectoryStore,
    TrajectoryWriter,
    step_file_name,
    tokenizer_id,
)
from graftrl.training.importer import import_jsonl
from graftrl.training.trajectories import rollout_records, stored_rows


def key(row: StoredTrajectory):
    return (row.source, row.group_index, row.index)


@pytest.fixture
def store(tmp_path) -> Path:
    root = tmp_path / "store"
    writer = TrajectoryWriter(root)
    writer.write_step(0, step_rows(0))
    writer.write_step(1, step_rows(1))
    return root


def rewrite(root: Path, step: int, table: pa.Table) -> None:
    """Replace a step file and fix its manifest checksum, so the damage is inside the file."""
    import hashlib

    path = root / step_file_name(step)
    pq.write_table(table, path)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"][path.name]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_round_trip(store):
    reader = TrajectoryStore(store)
    assert reader.steps() == [0, 1]
    assert reader.sources() == ["gpt2", "llama"]
    back = reader.read_step(1)
    assert sorted(back, key=key) == sorted(step_rows(1), key=key)
    assert {r.finish_reason for r in back} == {"stop", "length"}
    assert all(r.token_logprobs is None for r in reader.read_step(1, token_logprobs=False))
    record = back[0].to_record()
    assert record.mean_logprob == back[0].mean_logprob and record.finished == back[0].finished
    table = pq.read_table(store / "step_000001.parquet")
    assert table.schema.metadata[b"graftrl.schema_version"] == str(SCHEMA_VERSION).encode()
    assert table.schema.field("token_logprobs").type == pa.list_(pa.float32())
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["schema_version"] == SCHEMA_VERSION
    assert set(manifest["files"]) == {"step_000000.parquet", "step_000001.parquet"}
    report = reader.verify()
    assert report.ok and report.checked == {"step_000000.parquet": 8, "step_000001.parquet": 8}


def test_a_store_written_before_the_split_reads_back_identically(tmp_path):
    """tests/fixtures/store_v1 was written by graftrl at commit fbc7290, before the stored row
    became a TrajectoryRecord subclass and the importer left the store module."""
    old = FIXTURES / "store_v1"
    reader = TrajectoryStore(old)
    imported = [make_row(3, "imported", "p7", 0, i, float(i), token_logprobs=None) for i in range(2)]
    expected = {0: step_rows(0), 3: step_rows(3, prompts=("p1",)) + imported}
    assert reader.steps() == [0, 3] and reader.verify().ok
    for step, rows in expected.items():
        assert reader.read_step(step) == sorted(rows, key=key)
        # Writing the same rows today gives the same table, schema metadata included (the file
        # bytes also name the pyarrow version that wrote them).
        written = TrajectoryWriter(tmp_path / "new").write_step(step, rows)
        assert pq.read_table(written).equals(pq.read_table(old / written.name), check_metadata=True)


def test_the_stored_row_is_the_exchanged_record_plus_replay_fields():
    row = make_row(0, "llama", "p0", 0, 0, 1.0)
    record = row.to_record()
    assert isinstance(row, TrajectoryRecord) and type(record) is TrajectoryRecord
    assert record.to_dict() == {f.name: getattr(row, f.name) for f in dataclasses.fields(TrajectoryRecord)}
    replay = {k: v for k, v in row.to_dict().items() if k not in record.to_dict()}
    assert StoredTrajectory.from_record(record, **replay) == row
    # Every field but `finished` (stored as finish_reason) is a column of the same name.
    names = {f.name for f in dataclasses.fields(StoredTrajectory)} - {"finished"} | {"finish_reason"}
    assert names == set(SCHEMA.names)


def test_the_storage_layer_imports_no_model_training_or_reporting_code():
    """Not even lazily: scoring with a model (the importer) and rollouts live in graftrl.training."""
    above = ("graftrl.config", "graftrl.models", "graftrl.evaluation", "graftrl.training")
    above += ("graftrl.reporting", "graftrl.embedded", "graftrl.cli", "transformers")
    for path in Path(graftrl.storage.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = [name for name in names if name.startswith(above)]
            assert not bad, f"{path.name} line {node.lineno} imports {bad}"


def test_groups_and_latest_occurrence_rule(store):
    writer = TrajectoryWriter(store)
    # step 5: p1 drawn twice (positions 0 and 2), only llama; p0 absent.
    rows = [make_row(5, "llama", p, g, i, 1.0) for g, p in enumerate(["p1", "p2", "p1"]) for i in range(2)]
    writer.write_step(5, rows)
    reader = TrajectoryStore(store)
    found = reader.find_groups(["p0", "p1", "missing"], "llama")
    assert set(found) == {"p0", "p1"}
    assert [r.step for r in found["p0"]] == [1, 1]  # latest step holding p0
    assert {(r.step, r.group_index) for r in found["p1"]} == {(5, 2)}  # later position wins
    assert [r.index for r in found["p1"]] == [0, 1]
    assert found["p1"][0].token_logprobs is None  # find_groups skips per-token values by default
    at_step = reader.find_groups(["p0", "p1"], "gpt2", step=0, token_logprobs=True)
    assert {p: rows[0].step for p, rows in at_step.items()} == {"p0": 0, "p1": 0}
    assert at_step["p0"][0].token_logprobs is not None
    groups = reader.groups(step=1)
    assert set(groups) == {(p, s) for p in ("p0", "p1") for s in ("llama", "gpt2")}
    everything = reader.groups()
    assert everything[("p1", "llama")][0].step == 5 and everything[("p1", "gpt2")][0].step == 1
    assert set(reader.groups(source="gpt2", prompt_ids=["p1"])) == {("p1", "gpt2")}


def test_overwrite_and_truncate_after(store):
    writer = TrajectoryWriter(store)
    writer.write_step(1, step_rows(1, prompts=("p9",)))
    assert {r.prompt_id for r in TrajectoryStore(store).read_step(1)} == {"p9"}
    assert writer.truncate_after(0) == [1]
    assert TrajectoryStore(store).steps() == [0]
    assert (store / "discarded" / "step_000001.parquet").exists()


def test_crash_during_step_write_leaves_nothing_that_reads(store, monkeypatch):
    manifest_before = (store / "manifest.json").read_bytes()
    files_before = sorted(p.name for p in store.iterdir())

    def crash(src, dst):
        raise OSError("simulated crash")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        TrajectoryWriter(store).write_step(2, step_rows(2))
    monkeypatch.undo()
    assert sorted(p.name for p in store.iterdir()) == files_before  # no step file, no temp file
    assert (store / "manifest.json").read_bytes() == manifest_before
    reader = TrajectoryStore(store)
    assert reader.steps() == [0, 1] and reader.verify().ok


def test_crash_before_manifest_update_keeps_the_old_view(store, monkeypatch):
    manifest_before = (store / "manifest.json").read_bytes()
    real_replace = os.replace

    def crash_on_manifest(src, dst):
        if str(dst).endswith("manifest.json"):
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_manifest)
    with pytest.raises(OSError):
        TrajectoryWriter(store).write_step(2, step_rows(2))
    monkeypatch.undo()
    assert (store / "manifest.json").read_bytes() == manifest_before
    assert not [p for p in store.iterdir() if ".tmp-" in p.name]
    reader = TrajectoryStore(store)
    assert reader.steps() == [0, 1]  # the unlisted file is not read
    report = reader.verify()
    assert report.ok and any("step_000002.parquet" in w and "not listed" in w for w in report.warnings)


def test_checksum_mismatch_names_the_file(store):
    path = store / "step_000001.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    reader = TrajectoryStore(store)
    with pytest.raises(StoreError, match=r"step_000001\.parquet: checksum mismatch.*sha256") as error:
        reader.read_step(1)
    assert "restore" in str(error.value)
    assert reader.read_step(0)  # the other step is still readable
    report = reader.verify()
    assert not report.ok and len(report.problems) == 1 and "step_000001.parquet" in report.problems[0]


def test_truncated_parquet_is_named(store):
    path = store / "step_000000.parquet"
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(StoreError, match=r"step_000000\.parquet: checksum mismatch"):
        TrajectoryStore(store).read_step(0)
    # Even with a manifest that matches the truncated bytes, it is reported as unreadable.
    import hashlib

    manifest = json.loads((store / "manifest.json").read_text())
    manifest["files"][path.name]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"step_000000\.parquet: not a readable Parquet file"):
        TrajectoryStore(store).read_step(0)


def test_missing_file_is_named(store):
    (store / "step_000001.parquet").unlink()
    with pytest.raises(StoreError, match=r"step_000001\.parquet: missing, but manifest\.json lists it"):
        TrajectoryStore(store).read_step(1)


def test_missing_and_mistyped_columns_are_named(store):
    table = pq.read_table(store / "step_000001.parquet")
    rewrite(store, 1, table.drop_columns(["reward"]))
    with pytest.raises(StoreError, match=r"step_000001\.parquet: missing column 'reward'"):
        TrajectoryStore(store).read_step(1)
    index = table.schema.get_field_index("num_tokens")
    mistyped = table.set_column(index, "num_tokens", table.column("num_tokens").cast(pa.string()))
    rewrite(store, 1, mistyped)
    with pytest.raises(StoreError, match=r"column 'num_tokens' has type string.*expects int64"):
        TrajectoryStore(store).read_step(1)


def test_wrong_schema_version(store):
    table = pq.read_table(store / "step_000000.parquet")
    metadata = dict(table.schema.metadata)
    metadata[b"graftrl.schema_version"] = b"2"
    rewrite(store, 0, table.replace_schema_metadata(metadata))
    with pytest.raises(
        StoreError, match=r"step_000000\.parquet: schema version 2, but this graftrl reads version 1"
    ):
        TrajectoryStore(store).read_step(0)
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["schema_version"] = 7
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"manifest\.json: field 'schema_version' is 7"):
        TrajectoryStore(store)


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        (
            "reward",
            math.nan,
            r"column 'reward' at row 3 \(source 'gpt2', prompt_id 'p1', index 1\): reward is NaN",
        ),
        ("reward", math.inf, r"column 'reward' at row 3 .*must be a finite number"),
        ("num_tokens", -1, r"column 'num_tokens' at row 3 .*negative token count"),
        ("num_bytes", 3, r"column 'num_bytes' at row 3 .*UTF-8 length"),
        ("mean_logprob", -7.0, r"column 'mean_logprob' at row 3 .*mean of 'token_logprobs'"),
    ],
)
def test_bad_values_are_named_on_read_and_refused_on_write(store, column, value, message):
    table = pq.read_table(store / "step_000001.parquet")
    values = table.column(column).to_pylist()
    values[3] = value
    index = table.schema.get_field_index(column)
    rewrite(
        store,
        1,
        table.set_column(
            index, table.schema.field(column), pa.array(values, table.schema.field(column).type)
        ),
    )
    with pytest.raises(StoreError, match=r"step_000001\.parquet: " + message):
        TrajectoryStore(store).read_step(1)
    rows = sorted(step_rows(2), key=key)
    rows[3] = dataclasses.replace(rows[3], **{column: value})
    with pytest.raises(StoreError, match=r"step 2 \(not written\): " + message.replace("row 3", r"row \d")):
        TrajectoryWriter(store).write_step(2, rows)
    assert 2 not in TrajectoryStore(store).steps()


def test_incomplete_group_is_named(tmp_path):
    rows = step_rows(0)[:-1]
    with pytest.raises(
        StoreError, match=r"column 'index': group 1 of source 'gpt2' \(prompt 'p1'\) holds indices \[0\]"
    ):
        TrajectoryWriter(tmp_path / "s").write_step(0, rows)


# ----- import --------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_import_with_logprobs_computes_missing_advantages(tmp_path):
    lines = [
        {"prompt_id": "p0", "response": "12", "reward": 1, "token_logprobs": [-0.5, -0.25], "step": 3},
        {"prompt_id": "p0", "response": "13", "reward": 0, "mean_logprob": -1.5, "num_tokens": 4, "step": 3},
        {
            "prompt_id": "p0",
            "response": "14",
            "reward": 0,
            "token_logprobs": [],
            "step": 3,
            "finish_reason": "length",
        },
        {"prompt_id": 7, "response": "x", "reward": 1, "token_logprobs": [-1.0], "advantage": 0.0, "step": 3},
        {"prompt_id": "p0", "response": "y", "reward": True, "token_logprobs": [-2.0], "extra": "ignored"},
    ]
    summary = import_jsonl(write_jsonl(tmp_path / "peer.jsonl", lines), tmp_path / "store", source="vllm-run")
    assert summary.rows == 5 and summary.groups == 3 and summary.steps == [0, 3] and summary.scored == 0
    assert summary.computed_advantages == 2
    reader = TrajectoryStore(tmp_path / "store")
    group = reader.find_groups(["p0"], "vllm-run", step=3, token_logprobs=True)["p0"]
    expected = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0]]))[0].tolist()
    assert [r.advantage for r in group] == pytest.approx(expected)
    assert [r.mean_logprob for r in group] == pytest.approx([-0.375, -1.5, 0.0])
    assert [r.num_tokens for r in group] == [2, 4, 0]
    assert group[1].token_logprobs is None and group[0].token_logprobs == (-0.5, -0.25)
    assert [r.finish_reason for r in group] == ["stop", "stop", "length"]
    assert {r.n for r in group} == {3} and group[0].tokenizer_id == "unknown"
    assert reader.find_groups(["7"], "vllm-run")["7"][0].advantage == 0.0
    assert reader.find_groups(["p0"], "vllm-run")["p0"][0].step == 3  # latest occurrence
    # a second source merges into the same steps; the same source again is refused
    import_jsonl(write_jsonl(tmp_path / "b.jsonl", lines[:1]), tmp_path / "store", source="other")
    assert set(
        TrajectoryStore(tmp_path / "store").read_step(3, token_logprobs=False)[i].source for i in range(5)
    ) == {
        "other",
        "vllm-run",
    }
    with pytest.raises(StoreError, match=r"step 3 already holds trajectories from source\(s\) \['other'\]"):
        import_jsonl(tmp_path / "b.jsonl", tmp_path / "store", source="other")


def test_import_without_logprobs_refuses_naming_line_and_field(tmp_path):
    lines = [
        {"prompt_id": "p0", "response": "12", "reward": 1, "token_logprobs": [-0.5]},
        {"prompt_id": "p0", "response": "13", "reward": 0, "prompt": "What?"},
    ]
    path = write_jsonl(tmp_path / "peer.jsonl", lines)
    with pytest.raises(
        StoreError, match=r"peer\.jsonl line 2: missing field 'token_logprobs'.*pass --model PATH"
    ):
        import_jsonl(path, tmp_path / "store")
    assert not (tmp_path / "store" / "manifest.json").exists()
    result = CliRunner().invoke(app, ["import-trajectories", str(path), "--store", str(tmp_path / "store")])
    output = " ".join(result.output.split())  # rich wraps long lines
    assert result.exit_code == 2 and "pass --model PATH" in output and "peer.jsonl line 2" in output


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            {"prompt_id": "p", "response": "r", "reward": "1", "token_logprobs": []},
            r"line 1: field 'reward' must be a finite number",
        ),
        ({"prompt_id": "p", "reward": 1, "token_logprobs": []}, r"line 1: field 'response' is missing"),
        (
            {"prompt_id": "p", "response": "r", "reward": 1, "mean_logprob": -1.0},
            r"line 1: field 'num_tokens' is missing",
        ),
        (
            {"prompt_id": "p", "response": "r", "reward": 1, "token_logprobs": [0.5]},
            r"line 1: field 'token_logprobs'",
        ),
    ],
)
def test_import_names_bad_fields(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [line])
    with pytest.raises(StoreError, match=message):
        import_jsonl(path, tmp_path / "store")


def test_import_scores_missing_logprobs_with_the_source_model(tiny_checkpoints, tmp_path):
    model = tiny_checkpoints["llama"]
    lines = [
        {"prompt_id": "p0", "prompt": "12+3", "response": "\\boxed{15}", "reward": 1},
        {
            "prompt_id": "p0",
            "prompt": "12+3",
            "response": "\\boxed{1",
            "reward": 0,
            "finish_reason": "length",
        },
        {"prompt_id": "p1", "prompt": "4+5", "response": "", "reward": 0},
        {"prompt_id": "p1", "prompt": "4+5", "response": "9", "reward": 1, "token_logprobs": [-0.5]},
    ]
    path = write_jsonl(tmp_path / "peer.jsonl", lines)
    summary = import_jsonl(path, tmp_path / "store", model_path=model, template="{problem}=", device="cpu")
    assert summary.scored == 3 and summary.sources == ["llama"]
    policy = Policy.from_pretrained("llama", str(model), device="cpu", template="{problem}=")
    reader = TrajectoryStore(tmp_path / "store")
    rows = {(r.prompt_id, r.index): r for r in reader.read_step(0)}
    for (prompt_id, index), line in zip([("p0", 0), ("p0", 1), ("p1", 0)], lines, strict=False):
        finished = line.get("finish_reason", "stop") == "stop"
        prompt = policy.encode_prompts([line["prompt"]])
        response = policy.encode_response(line["response"], finished)
        scores = policy.score(prompt, [response])[0]
        content = scores[:-1] if finished else scores
        row = rows[(prompt_id, index)]
        assert row.num_tokens == len(content)
        expected = float(content.mean()) if len(content) else 0.0
        assert row.mean_logprob == pytest.approx(expected, abs=1e-6)
        assert row.token_logprobs == pytest.approx(content.tolist(), abs=1e-6)
        assert (row.eos_logprob is None) == (not finished)
        assert row.tokenizer_id == tokenizer_id(policy.tokenizer)
    assert rows[("p1", 1)].mean_logprob == -0.5  # given log-probs are kept


def test_import_cli_with_model(tiny_checkpoints, tmp_path):
    line = {"prompt_id": "p0", "prompt": "1+1", "response": "2", "reward": 1, "step": 4}
    path = write_jsonl(tmp_path / "peer.jsonl", [line, {**line, "response": "3", "reward": 0}])
    store = tmp_path / "store"
    args = ["import-trajectories", str(path), "--store", str(store), "--model", str(tiny_checkpoints["gpt2"])]
    result = CliRunner().invoke(
        app, [*args, "--template", "Q: {problem}\nA: ", "--device", "cpu", "--source", "peer"]
    )
    assert result.exit_code == 0, result.output
    rows = TrajectoryStore(store).read_step(4)
    assert [r.source for r in rows] == ["peer", "peer"] and [r.reward for r in rows] == [1.0, 0.0]
    assert rows[0].advantage == pytest.approx(0.7071, abs=1e-3)


# ----- rows from a real rollout ------------------------------------------------------------------


def test_stored_rows_on_a_real_rollout_batch(tiny_checkpoints, tmp_path):
    policy = Policy.from_pretrained(
        "gpt2", str(tiny_checkpoints["gpt2"]), template="Q: {problem}\nA: ", device="cpu"
    )
    problems = [MathProblem("a", "12+3", "15"), MathProblem("b", "4+56", "60")]
    prompts = [f"{p.problem} Answer." for p in problems]
    torch.manual_seed(0)
    batch = HFRolloutEngine().generate(policy, prompts, SamplingParams(n=3, max_new_tokens=6))
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    advantages = grpo_advantages(rewards)
    records = rollout_records(7, "gpt2", problems, batch, rewards, advantages)
    rows = stored_rows(records, batch, prompts, tokenizer_id(policy.tokenizer))
    assert len(rows) == 6
    for row_number, row in enumerate(rows):
        assert (row.prompt_id, row.group_index, row.index) == (
            problems[row_number // 3].id,
            row_number // 3,
            row_number % 3,
        )
        assert row.prompt_text == prompts[row_number // 3] and row.n == 3 and row.step == 7
        assert row.response == batch.texts[row_number] and row.finished == batch.finished[row_number]
        assert row.num_tokens == batch.content_length(row_number)
        assert row.mean_logprob == batch.content_mean_logprob(row_number)
        behaviour = batch.behaviour_logprobs[row_number]
        assert list(row.token_logprobs) == behaviour[: row.num_tokens].tolist()
        assert (row.eos_logprob is not None) == row.finished
        assert row.reward == float(rewards.view(-1)[row_number])
        assert row.advantage == float(advantages.view(-1)[row_number])
    TrajectoryWriter(tmp_path / "store").write_step(7, rows)
    back = TrajectoryStore(tmp_path / "store").read_step(7)
    assert sorted(back, key=key) == sorted(rows, key=key)
    assert back[0].to_record() == rows[0].to_record()
