"""Issue 46 on a pair graftrl's other tests never use (``user_pair``: a Gemma2 with a Unigram
tokenizer and no pad token, a GPT-NeoX with a byte-level BPE and a ChatML chat template): what a
command is asked is refused in one line, warned about, or done as asked, and estimates match the
model as it loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import FIXTURES
from typer.testing import CliRunner
from user_pair import build_gemma2_neox_pair

from graftrl.cli import app
from graftrl.config import load_config
from graftrl.models.memory import GIB, estimate_config


@pytest.fixture(scope="module")
def user_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_gemma2_neox_pair(tmp_path_factory.mktemp("gemma2-neox"))


def pair_config(pair: dict[str, Path], method: str = "grpo", **policy) -> dict:
    """A two-policy run on the user pair: 1 step of 4 prompts, n = 2, 8 new tokens."""
    return {
        "method": method,
        "policies": [
            {"name": name, "path": str(path), "template": "Q: {problem}\nA: ", **policy}
            for name, path in pair.items()
        ],
        "data": {"train": str(FIXTURES / "math_small.jsonl"), "prompt_suffix": None},
        "rollout": {"n": 2, "max_new_tokens": 8},
        "train": {"steps": 1, "batch_prompts": 4, "minibatch_prompts": 2},
        "optim": {"lr": 1e-3},
        "logging": {"progress": False},
    }


def write_config(folder: Path, raw: dict, name: str = "pair.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


# ----- estimate-memory: the attention the model loads with, train's context check -------------


def test_memory_estimate_uses_the_attention_gemma2_loads_with(user_pair, tmp_path):
    """Gemma2 loads with eager attention by default: the estimate with the default is the one
    with `eager` written out, and larger than the NeoX's default (sdpa) would count it; `sdpa`,
    which Gemma2 does not have, is refused in one line as loading refuses it."""

    def estimate(kernel: str | None) -> float:
        raw = pair_config({"gemma2": user_pair["gemma2"]})
        raw["rollout"]["max_new_tokens"] = 192
        if kernel is not None:
            raw["policies"][0]["attn_implementation"] = kernel
        estimates, _ = estimate_config(load_config(write_config(tmp_path, raw)), 24 * GIB, prompt_tokens=64)
        return estimates[0].activations

    assert estimate(None) == estimate("eager")
    raw = pair_config(user_pair)
    raw["rollout"]["max_new_tokens"] = 192
    raw["policies"][0]["attn_implementation"] = "sdpa"
    result = CliRunner().invoke(
        app, ["estimate-memory", str(write_config(tmp_path, raw)), "--prompt-tokens", "64"]
    )
    assert result.exit_code == 2 and "attn_implementation 'sdpa' does not load here" in result.output


def test_estimate_memory_applies_trains_context_check(user_pair, tmp_path):
    """A response budget the model's 256 positions cannot hold is refused in one line, as train
    refuses it; an assumed prompt longer than the context leaves counts only what train admits."""
    raw = pair_config(user_pair)
    raw["rollout"]["max_new_tokens"] = 300
    path = write_config(tmp_path, raw)
    result = CliRunner().invoke(app, ["estimate-memory", str(path), "--gpu-memory", "24"])
    assert result.exit_code == 2, result.output
    assert "rollout.max_new_tokens (300) leaves no room for a prompt in policy 'gemma2'" in result.output
    raw["rollout"]["max_new_tokens"] = 200
    config = load_config(write_config(tmp_path, raw))
    assert [e.activations for e in estimate_config(config, 24 * GIB, prompt_tokens=512)[0]] == [
        e.activations for e in estimate_config(config, 24 * GIB, prompt_tokens=56)[0]
    ]


# ----- chat templates: refused when absent, warned about when unused ----------------------------


@pytest.mark.parametrize("command", ["train", "probe"])
def test_chat_template_without_one_is_refused_before_models_load(user_pair, tmp_path, monkeypatch, command):
    """`chat_template: true` on Gemma2's tokenizer (none) was a transformers traceback, rc 1."""
    import graftrl.training.trainer as trainer

    def no_loading(*args, **kwargs):
        raise AssertionError("a model loaded before the chat template was checked")

    monkeypatch.setattr(trainer, "make_backend", no_loading)
    raw = pair_config(user_pair)
    raw["policies"][0]["chat_template"] = True
    path = write_config(tmp_path, raw)
    args = [command, str(path), "--out", str(tmp_path / "out")] + (
        ["--prompts", "4"] if command == "probe" else []
    )
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith(
        "error: policy 'gemma2': policies[].chat_template is true, but the tokenizer of"
    )
    assert "has no chat template" in lines[-1] and "Traceback" not in result.output


def test_eval_chat_template_without_one_is_refused(user_pair, tmp_path):
    bench = tmp_path / "bench.jsonl"
    bench.write_text((FIXTURES / "math_small.jsonl").read_text())
    result = CliRunner().invoke(
        app,
        [
            "eval",
            str(user_pair["gemma2"]),
            "-b",
            f"small={bench}",
            "--chat-template",
            "--out",
            str(tmp_path / "e"),
        ],
    )
    assert result.exit_code == 2, result.output
    assert "policy 'gemma2': --chat-template is true, but the tokenizer of" in result.output


def test_an_unused_chat_template_is_warned_about_once(user_pair, tmp_path, capsys):
    """NeoX's tokenizer has ChatML; a run that prompts it with a bare template is told so in one
    line (that was 0.8% against 56% held-out accuracy); Gemma2's, which has none, is not."""
    from graftrl.training.trainer import check_chat_templates

    config = load_config(write_config(tmp_path, pair_config(user_pair)))
    check_chat_templates(config)
    check_chat_templates(config)  # once per process
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("warning: policy 'neox': the tokenizer of")
    assert "has a chat template that goes unused" in lines[0]
    raw = pair_config(user_pair)
    raw["policies"][1]["chat_template"] = True
    check_chat_templates(load_config(write_config(tmp_path, raw)))
    assert not capsys.readouterr().err


# ----- relative paths resolve against the config file's folder ---------------------------------


def test_relative_paths_resolve_against_the_config_files_folder(user_pair, tmp_path, monkeypatch):
    """Every path field of a config in another folder names that folder's files, whatever the
    current directory: policies, data, validation files (mapping and specs), stored peers, store."""
    folder = tmp_path / "project"
    (folder / "data" / "eval").mkdir(parents=True)
    (folder / "data" / "train.jsonl").write_text((FIXTURES / "math_small.jsonl").read_text())
    (folder / "data" / "eval" / "small.jsonl").write_text((FIXTURES / "math_small.jsonl").read_text())
    (folder / "peer-store").mkdir()
    raw = pair_config(user_pair, method="graft")
    for policy in raw["policies"]:
        policy["path"] = f"models/{policy['name']}"
        (folder / "models").mkdir(exist_ok=True)
        (folder / "models" / policy["name"]).symlink_to(user_pair[policy["name"]])
    raw["data"]["train"] = "data/train.jsonl"
    raw["validation"] = {"files": {"small": "data/eval/small.jsonl"}}
    raw["peers"] = [{"name": "stored", "path": "peer-store"}]
    raw["store"] = {"record": True, "path": "recorded"}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(write_config(folder, raw))
    assert [p.path for p in config.policies] == [str(folder / "models" / n) for n in ("gemma2", "neox")]
    assert config.data.train == str(folder / "data" / "train.jsonl")
    assert config.validation.files == {"small": str(folder / "data" / "eval" / "small.jsonl")}
    assert config.peers[0].path == str(folder / "peer-store") and config.store.path == str(
        folder / "recorded"
    )
    raw["validation"] = {"files": ["small=data/eval/small.jsonl", "data/eval/small.jsonl", "MATH500"]}
    config = load_config(write_config(folder, raw))
    here = str(folder / "data" / "eval" / "small.jsonl")
    assert config.validation.files == [f"small={here}", here, "MATH500"]
    # a --set override is the command line's: the current directory's
    assert load_config(folder / "pair.yaml", ["data.train=mine.jsonl"]).data.train == "mine.jsonl"


def test_a_missing_relative_path_is_named_as_resolved(user_pair, tmp_path, monkeypatch):
    """The error names the path looked for (the config's folder's), not a bare relative name."""
    folder = tmp_path / "project"
    raw = pair_config(user_pair)
    raw["data"]["train"] = "data/missing.jsonl"
    path = write_config(folder, raw)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        app, ["train", str(path.relative_to(tmp_path)), "--out", str(tmp_path / "run")]
    )
    assert result.exit_code == 2, result.output
    assert f"{folder / 'data' / 'missing.jsonl'}: problem file not found" in " ".join(result.output.split())


def test_configs_read_from_the_current_directory_before_still_resolve(tmp_path, monkeypatch):
    """Backward compatible: a path that exists from the current directory (and not from the
    config's folder) is read as before, as the committed experiments' run configs are."""
    from conftest import CONFIGS

    repo = CONFIGS.parent
    monkeypatch.chdir(repo)
    runs = sorted((repo / "experiments").glob("worked/*/*/runs/*/config.yaml"))[:3]
    assert runs
    for run in runs:
        config = load_config(run.relative_to(repo))
        assert not Path(config.data.train).is_absolute() and Path(config.data.train).is_file()
    legacy = tmp_path / "sub"
    raw = {
        "method": "grpo",
        "policies": [{"name": "a", "path": "org/model"}],
        "data": {"train": str(FIXTURES.relative_to(repo) / "math_small.jsonl")},
    }
    config = load_config(write_config(legacy, raw))
    assert config.data.train == raw["data"]["train"] and config.policies[0].path == "org/model"  # a hub id


def test_eval_warns_of_an_unused_chat_template_before_any_model_loads(user_pair, capsys):
    from graftrl.evaluation.benchmarks import load_benchmarks
    from graftrl.evaluation.evaluate import EvalProtocol, check_prompts
    from graftrl.evaluation.targets import ModelTarget

    benchmarks = load_benchmarks([f"small={FIXTURES / 'math_small.jsonl'}"])
    target = ModelTarget("neox-eval", str(user_pair["neox"]), policy="neox-eval")
    check_prompts([target], benchmarks, EvalProtocol(max_new_tokens=8))
    err = " ".join(capsys.readouterr().err.split())
    assert "warning: policy 'neox-eval': the tokenizer of" in err and "pass --chat-template if" in err
    check_prompts(
        [ModelTarget("neox-chat", str(user_pair["neox"]), "neox-chat", chat_template=True)],
        benchmarks,
        EvalProtocol(max_new_tokens=8),
    )
    assert not capsys.readouterr().err
