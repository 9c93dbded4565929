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
