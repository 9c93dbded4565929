"""The bad-input table of issue 12: every anticipated error is one line naming the field or file,
exit code 2, no traceback, and no pre-existing file changed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import FIXTURES
from typer.testing import CliRunner

from graftrl.cli import app
from graftrl.config import config_from_dict, minibatch_note
from graftrl.errors import ModelError
from graftrl.models.prompts import check_prompt_lengths
from graftrl.storage.data import PAPER_PROMPT_SUFFIX


def base_config(paths: dict[str, Path], data: Path) -> dict:
    return {
        "method": "graft",
        "policies": [
            {"name": "llama", "path": str(paths["llama"]), "template": "{problem}="},
            {"name": "gpt2", "path": str(paths["gpt2"])},
        ],
        "data": {"train": str(data), "prompt_suffix": None},
        "rollout": {"n": 2, "max_new_tokens": 6},
        "train": {"steps": 1, "batch_prompts": 2, "minibatch_prompts": 2},
        "logging": {"progress": False},
    }


@dataclass
class Case:
    """Prepare files in the folder, return CLI args; the message must contain ``names``."""

    prepare: Callable[[Path, dict[str, Path]], list[str]]
    names: str


def train_with(edit: Callable[[dict, Path, dict[str, Path]], None], *extra: str):
    def prepare(folder: Path, paths: dict[str, Path]) -> list[str]:
        data = folder / "data.jsonl"
        shutil.copy(FIXTURES / "math_small.jsonl", data)
        config = base_config(paths, data)
        edit(config, folder, paths)
        (folder / "run.yaml").write_text(yaml.safe_dump(config))
        return ["train", str(folder / "run.yaml"), "--out", str(folder / "run"), *extra]

    return prepare


def raw_config(text: bytes):
    def prepare(folder: Path, paths: dict[str, Path]) -> list[str]:
        (folder / "run.yaml").write_bytes(text)
        return ["train", str(folder / "run.yaml"), "--out", str(folder / "run")]

    return prepare


def no_tokenizer(config: dict, folder: Path, paths: dict[str, Path]) -> None:
    model = folder / "model-without-tokenizer"
    shutil.copytree(paths["gpt2"], model)
    for file in model.iterdir():
        if "token" in file.name or file.name in ("vocab.json", "merges.txt"):
            file.unlink()
    config["policies"][1]["path"] = str(model)


def no_eos_token(config: dict, folder: Path, paths: dict[str, Path]) -> None:
    model = folder / "model-without-eos"
    shutil.copytree(paths["gpt2"], model)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    for key in ("eos_token", "pad_token"):
        tokenizer_config.pop(key, None)
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config["policies"][1]["path"] = str(model)


def nan_weight(config: dict, folder: Path, paths: dict[str, Path]) -> None:
    from safetensors.torch import load_file, save_file

    model = folder / "model-with-nan"
    shutil.copytree(paths["llama"], model)
    weights = load_file(model / "model.safetensors")
    name = sorted(weights)[-1]
    weights[name][0] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    config["policies"][0]["path"] = str(model)


def out_is_a_file(folder: Path, paths: dict[str, Path]) -> list[str]:
    args = train_with(lambda *a: None)(folder, paths)
    (folder / "a-file").write_text("not a run folder")
    return [*args[:-1], str(folder / "a-file")]


def resume_on_changed_data(folder: Path, paths: dict[str, Path]) -> list[str]:
    """A 1-step run with a checkpoint, then one problem of its data file edited."""
    args = train_with(set_key("checkpoint.every", 1))(folder, paths)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = folder / "data.jsonl"
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[1:]))
    return [*args, "--resume", "--set", "train.steps=2"]


def data_file(content: bytes, name: str = "bad.jsonl"):
    def edit(config: dict, folder: Path, paths: dict[str, Path]) -> None:
        (folder / name).write_bytes(content)
        config["data"]["train"] = str(folder / name)

    return edit


def set_key(dotted: str, value):
    def edit(config: dict, folder: Path, paths: dict[str, Path]) -> None:
        node = config
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    return edit


def imported(lines: list[bytes] | None, store: str = "store", folder_input: bool = False):
    def prepare(folder: Path, paths: dict[str, Path]) -> list[str]:
        source = folder / "trajectories.jsonl"
        if folder_input:
            source.mkdir()
        else:
            source.write_bytes(b"".join(line + b"\n" for line in lines or []))
        (folder / "a-file").write_text("not a folder")
        return ["import-trajectories", str(source), "--store", str(folder / store)]

    return prepare


def line(prompt_id: str, index: int, reward: int = 1) -> bytes:
    row = {
        "prompt_id": prompt_id,
        "response": f"r{index}",
        "reward": reward,
        "mean_logprob": -1.0,
        "num_tokens": 3,
    }
    return json.dumps(row).encode()


HUGE = json.dumps({"id": "huge-1", "problem": "1+" * 500_000 + "1", "answer": "500001"}).encode() + b"\n"

CASES = {
    "unknown key": Case(train_with(set_key("optim.learning_rate", 1)), "optim.learning_rate: unknown key"),
    "wrong type": Case(train_with(set_key("train.steps", "many")), "train.steps"),
    "missing field": Case(raw_config(b"policies: []\n"), "data"),
    "invalid YAML": Case(raw_config(b"train: [1, 2\n"), "not valid YAML"),
    "non-UTF-8 config": Case(raw_config(b"seed: \xff\xfe\n"), "not UTF-8"),
    "missing data file": Case(
        train_with(set_key("data.train", "/nonexistent/train.jsonl")), "/nonexistent/train.jsonl"
    ),
    "bad JSON data": Case(train_with(data_file(b'{"problem": "1+1", "answer": 2}\n{oops\n')), "bad.jsonl"),
    "data without answer": Case(train_with(data_file(b'{"problem": "1+1"}\n')), "answer"),
    "policy path missing": Case(
        train_with(
            set_key(
                "policies", [{"name": "a", "path": "/nonexistent/model"}, {"name": "b", "path": "/x/y/z"}]
            )
        ),
        "/nonexistent/model does not exist",
    ),
    "folder without config.json": Case(
        train_with(
            lambda c, folder, p: (
                folder.joinpath("empty").mkdir(),
                c["policies"][0].update(path=str(folder / "empty")),
            )
        ),
        "no config.json",
    ),
    "no tokenizer": Case(train_with(no_tokenizer), "cannot load a tokenizer"),
    "--set policies.5.lr": Case(
        train_with(lambda *a: None, "--set", "policies.5.lr=0.1"), "policies is a list of 2"
    ),
    "--set policies.x.lr": Case(train_with(lambda *a: None, "--set", "policies.x.lr=0.1"), "got 'x'"),
    "--set without =": Case(train_with(lambda *a: None, "--set", "train.steps"), "KEY=VALUE"),
    "delta 1.5": Case(train_with(set_key("graft.delta", 1.5)), "graft.delta"),
    "n 1": Case(train_with(set_key("rollout.n", 1)), "rollout.n"),
    "minibatch larger than batch": Case(
        train_with(set_key("train.minibatch_prompts", 4)), "minibatch_prompts"
    ),
    "overlong prompt": Case(train_with(data_file(HUGE)), "'huge-1'"),
    "prompts made too long by the suffix": Case(
        train_with(
            lambda c, *a: c["data"].update(prompt_suffix=PAPER_PROMPT_SUFFIX),
            "--set",
            "rollout.max_new_tokens=412",
        ),
        "set data.prompt_suffix: null",
    ),
    "response limit beyond the context": Case(
        train_with(set_key("rollout.max_new_tokens", 4096)), "rollout.max_new_tokens"
    ),
    "tokenizer without EOS": Case(train_with(no_eos_token), "has no eos_token"),
    "weights holding NaN": Case(train_with(nan_weight), "holds NaN or inf"),
    "--out is a file": Case(out_is_a_file, "is a file, not a folder"),
    "resume on changed data": Case(resume_on_changed_data, "changed since step_000001 was written"),
    "import non-UTF-8": Case(imported([line("p", 0), b'{"prompt_id": "\xff"}']), "line 2: not UTF-8"),
    "import a folder": Case(imported(None, folder_input=True), "is a folder"),
    "import into an uncreatable store": Case(
        imported([line("p", 0), line("p", 1)], store="a-file/store"), "a-file/store"
    ),
    "import bad JSON": Case(imported([line("p", 0), b"{oops"]), "line 2: not valid JSON"),
}


def digest(folder: Path) -> dict[str, str]:
    """Every file's hash, but the run lock's: each process that takes the lock (a refused resume
    too, which takes it before it checks) writes its pid and start time there."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != "run.lock"
    }


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_and_changes_nothing(name, tiny_checkpoints, tmp_path):
    case = CASES[name]
    folder = tmp_path / "work"
    folder.mkdir()
    args = case.prepare(folder, tiny_checkpoints)
    before = digest(folder)
    result = CliRunner().invoke(app, args)
    output = result.output.strip()
    assert result.exit_code == 2, (result.exit_code, output, result.exception)
    assert isinstance(result.exception, SystemExit)  # handled, not a crash
    assert "Traceback" not in output
    assert len(output.splitlines()) == 1, output
    assert output.startswith("error: ") and case.names in output, output
    after = digest(folder)
    assert {k: after.get(k) for k in before} == before  # every pre-existing file unchanged


def test_batch_not_divisible_by_minibatch_is_said_not_refused(tiny_checkpoints):
    config = config_from_dict(
        base_config(tiny_checkpoints, FIXTURES / "math_small.jsonl")
        | {"train": {"steps": 1, "batch_prompts": 5, "minibatch_prompts": 2}}
    )
    assert minibatch_note(config) == (
        "train.batch_prompts (5) is not a multiple of train.minibatch_prompts (2): each epoch's last "
        "optimizer step takes the remaining 1 group(s)"
    )
    assert (
        minibatch_note(config_from_dict(base_config(tiny_checkpoints, FIXTURES / "math_small.jsonl"))) is None
    )


def test_unexpected_errors_keep_their_traceback(monkeypatch, tmp_path):
    """Only anticipated errors become one line: a bug still surfaces as an exception."""
    import graftrl.config

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(graftrl.config, "load_config", broken)
    result = CliRunner().invoke(app, ["train", str(tmp_path / "x.yaml")])
    assert result.exit_code == 1 and isinstance(result.exception, KeyError)


def test_unequal_imported_groups_are_said(tmp_path):
    """The store keeps each group's n, so the file imports, with one note naming the odd group."""
    folder = tmp_path / "work"
    folder.mkdir()
    args = imported([line("p", 0), line("p", 1), line("q", 0), line("r", 0), line("r", 1)])(folder, {})
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    notes = [row for row in result.output.splitlines() if row.startswith("note:")]
    assert len(notes) == 1 and "prompt 'q'" in notes[0] and "has 1 responses" in notes[0], result.output


def test_a_prompt_too_long_shows_it_rendered_and_names_the_template_and_the_suffix(
    tiny_checkpoints, tmp_path
):
    """A config copied without `data.prompt_suffix: null` (issue 57): the user sees a short
    problem, so the message shows the prompt the policy got and what made it long, with the fix."""
    args = CASES["prompts made too long by the suffix"].prepare(tmp_path, tiny_checkpoints)
    output = CliRunner().invoke(app, args).output.strip()
    assert (
        "as rendered (policies[].template '{problem}='; data.prompt_suffix \"Let's think step by step"
        in output
    )
    assert "tokens without it): '" in output  # then the prompt, its head and tail: it ends in the suffix
    assert "' ... '" in output and "output the final answer within \\\\boxed{}.=' (" in output
    assert output.endswith(
        "set data.prompt_suffix: null (or a shorter suffix), or lower rollout.max_new_tokens"
    )


def test_the_too_long_message_shortens_the_prompt_and_names_a_flag_or_a_chat_template():
    def check(problems, suffix, **names):
        with pytest.raises(ModelError) as error:
            check_prompt_lengths(
                "m",
                96,
                lambda p: f"<{p}>\n",
                lambda t: list(t.encode()),
                problems,
                80,
                **names,
                suffix=suffix,
            )
        return str(error.value)

    suffix = "Think step by step."
    text = check([("a", f"1+2 {suffix}")], suffix, limit="--max-new-tokens", suffix_field="--prompt-suffix",
                 template="the chat template of /models/x")  # fmt: skip
    assert "(the chat template of /models/x; --prompt-suffix 'Think step by step.' appended; 6 tokens" in text
    assert "'<1+2 Think step by step.>\\n'" in text  # one line: the newline escaped
    assert text.endswith("pass --prompt-suffix '' (or a shorter suffix), or lower --max-new-tokens")
    long = check([("b", "9" * 500 + f" {suffix}")], suffix)  # too long without the suffix too
    assert f"'<{'9' * 59}' ... '" in long and "(523 characters)" in long and "without it" not in long
    assert long.endswith("remove or shorten them, or lower rollout.max_new_tokens") and "\n" not in long


def test_a_real_process_prints_one_line_and_no_traceback(tiny_checkpoints, tmp_path):
    """The console entry as a user runs it: exit 2, one line on stdout, nothing on stderr."""
    args = CASES["overlong prompt"].prepare(tmp_path, tiny_checkpoints)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-m", "graftrl.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == "" and len(result.stdout.strip().splitlines()) == 1
    assert result.stdout.startswith("error: data.train:") and "'huge-1'" in result.stdout


def test_an_error_from_a_ray_actor_prints_its_own_message(monkeypatch, tmp_path):
    """Ray re-raises an actor's error as a subclass of its class carrying ``cause`` and the remote
    traceback in its text; the boundary prints the cause's one line."""
    import graftrl.config
    from graftrl.errors import ModelError

    class RemoteModelError(ModelError):  # what ray.exceptions.RayTaskError.as_instanceof_cause builds
        def __init__(self, cause):
            super().__init__("ray::PolicyWorker.__init__()\nTraceback (most recent call last):\n  ...")
            self.cause = cause

    def remote(*args, **kwargs):
        raise RemoteModelError(ModelError("policy 'a': model folder /x does not exist; fix policies[].path"))

    monkeypatch.setattr(graftrl.config, "load_config", remote)
    result = CliRunner().invoke(app, ["train", str(tmp_path / "x.yaml")])
    assert result.exit_code == 2
    assert result.output.strip() == "error: policy 'a': model folder /x does not exist; fix policies[].path"


def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_last_checkpoint(
    monkeypatch, tiny_checkpoints, tmp_path
):
    """The disk fills while step 2's checkpoint is written (as safetensors reports it): one line
    saying what a checkpoint needs, the partial folder removed, step 1's checkpoint untouched."""
    from graftrl.training.worker import PolicyWorker

    folder = tmp_path / "work"
    folder.mkdir()
    args = train_with(set_key("checkpoint.every", 1))(folder, tiny_checkpoints)
    assert CliRunner().invoke(app, args).exit_code == 0
    checkpoints = folder / "run" / "checkpoints"
    before = digest(checkpoints)

    def full(self, request):
        target = request.folders[self.index]
        Path(target).mkdir(parents=True, exist_ok=True)
        (Path(target) / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(PolicyWorker, "save", full)
    result = CliRunner().invoke(app, [*args, "--resume", "--set", "train.steps=2"])
    output = result.output.strip()
    assert result.exit_code == 2 and len(output.splitlines()) == 1, output
    assert "no space left" in output and "a checkpoint needs about" in output, output
    assert "step_000001 is intact" in output and "then --resume" in output, output
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001"]  # staging removed
    assert digest(checkpoints) == before


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (PermissionError(13, "Permission denied", "/data/run/metrics.jsonl"), "check the path's permissions"),
        (OSError(28, "No space left on device", "/data/run/store"), "free disk space"),
        (FileNotFoundError(2, "No such file or directory", "/data/train.jsonl"), "check the path"),
        (MemoryError(), "out of memory"),
    ],
)
def test_errors_of_the_machine_are_one_line_naming_the_path(monkeypatch, tmp_path, error, says):
    """An OSError (with an errno) or MemoryError from the environment: one line, exit 2."""
    import graftrl.config

    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(graftrl.config, "load_config", fails)
    result = CliRunner().invoke(app, ["train", str(tmp_path / "x.yaml")])
    output = result.output.strip()
    assert result.exit_code == 2 and len(output.splitlines()) == 1, output
    assert output.startswith("error: ") and says in output, output
    assert getattr(error, "filename", None) is None or error.filename in output
    monkeypatch.setenv("GRAFTRL_TRACEBACK", "1")
    assert CliRunner().invoke(app, ["train", str(tmp_path / "x.yaml")]).exception is error
