"""Shared fixtures: two tiny heterogeneous checkpoints saved and loaded by path, as real ones are."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Every model in the tests is built here: never wait on a hub that this machine cannot reach.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The test models are tiny: one intra-op thread is as fast, and two threads per process thrash
# when several test processes or workers share the 2 cores.
torch.set_num_threads(1)

FIXTURES = Path(__file__).parent / "fixtures"


def build_checkpoints(root: Path, hidden: int, heads: int) -> dict[str, Path]:
    """A char-level Llama and a BPE GPT-2 (random init), saved with save_pretrained under root."""
    from graftrl.embedded.models import build_bpe_tokenizer, build_char_tokenizer, build_model
    from graftrl.storage.data import load_problems

    corpus = [p.problem + " " + p.answer for p in load_problems(FIXTURES / "math_small.jsonl")]
    corpus += [f"\\boxed{{{i}}}" for i in range(200)]
    specs = {
        "llama": ("llama", build_char_tokenizer()),
        "gpt2": ("gpt2", build_bpe_tokenizer(corpus, vocab_size=300)),
    }
    paths = {}
    for name, (arch, tokenizer) in specs.items():
        model = build_model(arch, tokenizer, hidden=hidden, layers=2, heads=heads, max_positions=512, seed=1)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = root / name
    return paths


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny heterogeneous checkpoints (hidden 32, 2 heads), loaded by path as real ones are."""
    return build_checkpoints(tmp_path_factory.mktemp("checkpoints"), hidden=32, heads=2)


@pytest.fixture(scope="session")
def vllm_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same with 32-wide attention heads, the smallest vLLM's CPU kernels run."""
    return build_checkpoints(tmp_path_factory.mktemp("vllm_checkpoints"), hidden=64, heads=2)


@pytest.fixture(autouse=True)
def _logged_metric_keys_are_declared(monkeypatch: pytest.MonkeyPatch):
    """Every metrics key a test's training logs must be declared in graftrl.storage.rundir.METRIC_KEYS
    (the schema behind docs/metrics.md and the sinks); a new metric without a declaration fails here."""
    from graftrl.storage.metrics import MetricsLogger
    from graftrl.storage.rundir import undeclared_keys

    undeclared: set[str] = set()
    original = MetricsLogger.log

    def log(self: MetricsLogger, row: dict) -> None:
        undeclared.update(undeclared_keys([row]))
        original(self, row)

    monkeypatch.setattr(MetricsLogger, "log", log)
    yield
    assert not undeclared, (
        f"metrics keys logged but not declared in graftrl.storage.rundir.METRIC_KEYS: {sorted(undeclared)}; "
        "declare them and regenerate docs/metrics.md (graftrl metrics-reference --markdown)"
    )
