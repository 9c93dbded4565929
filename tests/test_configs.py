"""The shipped configs/ validate and carry the paper's hyperparameters (paths need not exist)."""

from __future__ import annotations

import pytest
from conftest import CONFIGS

from graftrl.config import ConfigError, config_from_dict, load_config
from graftrl.storage.data import PAPER_PROMPT_SUFFIX

FILES = sorted(CONFIGS.glob("*.yaml"))
BENCHMARKS = ["MATH500", "AIME2024", "AIME2025", "AMC23", "Minerva"]


def test_configs_exist():
    names = {p.name for p in FILES}
    for pair in (1, 2, 3):
        assert f"pair{pair}-graft.yaml" in names
    for model in ("smollm3", "qwen3", "octothinker"):
        for n in (8, 16, 32):
            assert f"grpo-n{n}-{model}.yaml" in names
    assert (CONFIGS / "README.md").is_file()


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_config_validates(path):
    config = load_config(path)  # model and data paths need not exist
    assert config.policies and config.data.train


PAPER_FILES = [
    p
    for p in FILES
    if p.name.startswith(("pair", "grpo-")) and "hacpo" not in p.name and "stored" not in p.name
]


def test_hacpo_config_has_the_reviews_settings():
    config = load_config(CONFIGS / "pair1-hacpo.yaml")
    assert config.method == "hacpo" and len(config.policies) == 2 and config.rollout.n == 8
    assert config.train.minibatch_prompts == 64 and config.train.kl_coef == 1e-3


@pytest.mark.parametrize("path", PAPER_FILES, ids=[p.name for p in PAPER_FILES])
def test_graft_and_grpo_configs_have_the_papers_settings(path):
    config = load_config(path)
    assert config.train.steps == 174
    assert (config.train.batch_prompts, config.train.minibatch_prompts, config.train.update_epochs) == (
        128,
        32,
        1,
    )
    assert (config.train.eps_low, config.train.eps_high) == (0.2, 0.28)
    assert (
        config.optim.lr == 1e-6 and config.optim.betas == (0.9, 0.999) and config.optim.weight_decay == 0.01
    )
    assert config.optim.grad_clip == 1.0
    assert (config.rollout.temperature, config.rollout.top_p, config.rollout.max_new_tokens) == (
        1.0,
        1.0,
        4096,
    )
    assert config.data.prompt_suffix == PAPER_PROMPT_SUFFIX
    assert config.data.train == str(
        CONFIGS.parent / "data" / "math_train.jsonl"
    )  # the clone's, from anywhere
    assert all(p.dtype == "bfloat16" and p.path.startswith("/models/") for p in config.policies)
    validation = config.validation
    assert list(validation.files) == BENCHMARKS and validation.every == 5
    assert (validation.samples, validation.temperature, validation.top_p) == (8, 0.6, 0.95)
    assert validation.max_new_tokens is None  # the training length limit
    if config.method == "graft":
        assert len(config.policies) == 2 and config.rollout.n == 8
        assert (config.graft.delta, config.graft.balance, config.graft.peer_position) == (0.8, True, "last")
    else:
        n = int(path.stem.split("-")[1][1:])
        assert config.method == "grpo" and len(config.policies) == 1 and config.rollout.n == n


def test_pairs_are_the_papers():
    pairs = {
        1: ["/models/SmolLM3-3B-Base", "/models/Qwen3-1.7B-Base"],
        2: ["/models/OctoThinker-3B-Hybrid-Base", "/models/Qwen3-1.7B-Base"],
        3: ["/models/SmolLM3-3B-Base", "/models/OctoThinker-3B-Hybrid-Base"],
    }
    for pair, paths in pairs.items():
        config = load_config(CONFIGS / f"pair{pair}-graft.yaml")
        assert [p.path for p in config.policies] == paths


def test_stored_peer_config_replays_the_partners_grpo_run():
    config = load_config(CONFIGS / "pair1-graft-stored-peer.yaml")
    partner = load_config(CONFIGS / "grpo-n8-qwen3.yaml")
    assert config.method == "graft" and [p.name for p in config.policies] == ["smollm3"]
    assert [(p.name, p.match) for p in config.peers] == [(partner.policies[0].name, "step")]
    assert config.seed == partner.seed and config.train.batch_prompts == partner.train.batch_prompts
    assert config.rollout.n == partner.rollout.n == 8 and not config.graft.balance


def test_validation_section_forms():
    base = {"policies": [{"name": "a", "path": "x"}], "method": "grpo", "data": {"train": "t.jsonl"}}
    assert config_from_dict(base).validation.specs() == []
    as_map = config_from_dict({**base, "validation": {"files": {"m": "m.jsonl"}, "every": 2}})
    assert as_map.validation.specs() == ["m=m.jsonl"]
    as_list = config_from_dict({**base, "validation": {"files": ["MATH500", "x=y.parquet"]}})
    assert as_list.validation.specs() == ["MATH500", "x=y.parquet"]
    with pytest.raises(ConfigError, match=r"validation\.every"):
        config_from_dict({**base, "validation": {"every": 0}})
    with pytest.raises(ConfigError, match=r"validation\.sample: unknown key"):
        config_from_dict({**base, "validation": {"sample": 4}})
