"""Shared fixtures and builders: two tiny heterogeneous checkpoints saved and loaded by path, as
real ones are; a two-policy run config on them; scripted and text-hashing verifiers. Test modules
import the builders with ``from conftest import ...``."""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from graftrl.storage.store import StoredTrajectory

if TYPE_CHECKING:
    from graftrl.experiments.compare.task import CompareTask
    from graftrl.training.trainer import Trainer

# Every model in the tests is built here: never wait on a hub that this machine cannot reach.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The test models are tiny: one intra-op thread is as fast, and two threads per process thrash
# when several test processes or workers share the 2 cores.
torch.set_num_threads(1)

FIXTURES = Path(__file__).parent / "fixtures"
SRC = Path(__file__).parents[1] / "src"
"""The package source, for the PYTHONPATH of subprocesses."""
CONFIGS = Path(__file__).parents[1] / "configs"


# ----- builders shared by the test modules ----------------------------------------------------


class ScriptedRewards:
    """Rewards by (call, prompt, sample) so a test can force a given exchange pattern.

    The trainer scores each policy once per step in policy order; ``patterns[call % K]`` is a
    [P, n] list of rewards for that policy. Everything else in the run is real.
    """

    def __init__(self, patterns: Sequence[list[list[float]]]) -> None:
        self.patterns = patterns
        self.calls = 0
        self.given: list[list[list[float]]] = []
        """The pattern given at each call."""

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        pattern = self.patterns[self.calls % len(self.patterns)]
        self.calls += 1
        self.given.append(pattern)
        flat = [r for group in pattern for r in group]
        assert len(flat) == len(responses)
        return flat

    def close(self) -> None:
        pass


def comparable_metrics(run: Path) -> list[dict]:
    """Metrics rows without wall-clock and memory figures, which are measurements, not results."""
    from graftrl.storage.rundir import read_metrics

    return [
        {k: v for k, v in row.items() if not k.startswith(("time_", "memory_"))} for row in read_metrics(run)
    ]


def make_config(paths: dict[str, Path], method: str = "graft", **train) -> dict:
    """A two-policy run (n = 4, 2 steps of 4 prompts) on ``tiny_checkpoints``; ``train`` overrides."""
    return {
        "method": method,
        "seed": 3,
        "policies": [
            {"name": "llama", "path": str(paths["llama"]), "template": "{problem}="},
            {"name": "gpt2", "path": str(paths["gpt2"]), "template": "Q: {problem}\nA: "},
        ],
        "data": {"train": str(FIXTURES / "math_small.jsonl"), "prompt_suffix": None},
        "rollout": {"n": 4, "max_new_tokens": 8},
        "train": {"steps": 2, "batch_prompts": 4, "minibatch_prompts": 2, "micro_batch_size": 5, **train},
        "optim": {"lr": 1e-2},
        "logging": {"progress": False},
    }


# llama fails prompt 0 entirely while gpt2 is mixed there; the reverse on prompt 1; both mixed
# on prompts 2 and 3. So each direction has exactly one candidate and m = 1.
CROSSED = [
    [[0, 0, 0, 0], [1, 0, 1, 0], [1, 0, 0, 0], [0, 1, 1, 1]],  # llama
    [[1, 1, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 1]],  # gpt2
]
ALL_MIXED = [
    [[1, 0, 0, 0], [1, 0, 1, 0], [1, 0, 0, 0], [0, 1, 1, 1]],
    [[1, 1, 0, 0], [0, 1, 0, 0], [0, 1, 0, 0], [1, 1, 0, 1]],
]


def weights_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        f"{p.name}.{k}": v.detach().clone() for p in trainer.policies for k, v in p.model.state_dict().items()
    }


class TextRewards:
    """A pure function of the response text (so every process scores alike), about 1 in 4 correct:
    the random tiny models get mixed and all-fail groups, hence real exchanges."""

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        return [float(zlib.crc32(r.encode()) % 4 == 0) for r in responses]

    def close(self) -> None:
        pass


def make_row(
    step: int, source: str, prompt: str, group: int, index: int, reward: float, n: int = 2, **kw
) -> StoredTrajectory:
    """A stored row whose log-probs are float32-exact; ``kw`` overrides fields."""
    finished = index % 2 == 0
    values = (-0.5, -0.25, -1.0)[: 1 + index % 3]  # float32-exact, so they round-trip exactly
    text = f"answer {prompt} {index} é"
    fields = {
        "prompt_id": prompt,
        "step": step,
        "source": source,
        "index": index,
        "response": text,
        "reward": reward,
        "advantage": 0.7071 if reward else -0.7071,
        "mean_logprob": sum(values) / len(values),
        "num_tokens": len(values),
        "num_bytes": len(text.encode("utf-8")),
        "finished": finished,
        "prompt_text": f"What is {prompt}?",
        "tokenizer_id": f"{source}@0123",
        "n": n,
        "group_index": group,
        "token_logprobs": values,
        "eos_logprob": -0.125 if finished else None,
    }
    fields.update(kw)
    return StoredTrajectory(**fields)


def step_rows(step: int, prompts=("p0", "p1"), sources=("llama", "gpt2")) -> list[StoredTrajectory]:
    """Rows of a complete step: 2 responses per (source, prompt)."""
    return [
        make_row(step, source, prompt, g, i, float((i + g) % 2))
        for source in sources
        for g, prompt in enumerate(prompts)
        for i in range(2)
    ]


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# ----- checkpoints ----------------------------------------------------------------------------


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


def write_sums(path: Path, count: int, seed: int, prefix: str, top: int = 2) -> Path:
    """``count`` sums of numbers below ``top`` as a problem file (JSONL rows id, problem, answer),
    e.g. ``1+0`` -> 1: small answers, so a random model's last number is sometimes right."""
    import json
    import random

    rng = random.Random(seed)
    pairs = [(rng.randrange(top), rng.randrange(top)) for _ in range(count)]
    rows = [
        {"id": f"{prefix}{i}", "problem": f"{a}+{b}", "answer": str(a + b)} for i, (a, b) in enumerate(pairs)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def build_qwen2_llama_pair(root: Path) -> dict[str, Path]:
    """A real pair of different architectures and tokenizers, built here: a Qwen2 with a byte-level
    BPE trained here (loaded back as transformers' Qwen2Tokenizer) and a Llama with a Unigram /
    Metaspace tokenizer (SentencePiece-style, a fixed vocabulary), hidden 32, 2 layers, random init,
    saved with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    corpus = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
    corpus += [f"Q: {a}+{b}\nA: the sum is \\boxed{{{a + b}}}" for a in range(10) for b in range(10)]
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
        ),
    )
    # A SentencePiece-style Unigram with a fixed vocabulary: the tokenizers library's Unigram
    # trainer gives another vocabulary in every process, and with it other samples.
    words = ["▁Q:", "▁A:", "▁the", "▁sum", "▁is", "▁\\boxed{", "}", "+", "="]
    chars = sorted(set("".join(corpus).replace(" ", "")) | {"▁"})
    vocab = (
        [(s, 0.0) for s in specials]
        + [(w, -2.0) for w in words]
        + [(c, -5.0) for c in chars if c not in words]
    )
    unigram = Tokenizer(models.Unigram(vocab, unk_id=specials.index("<unk>")))
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.decoder = decoders.Metaspace()
    paths = {}
    for name, tok, config_class, model_class in (
        ("qwen", bpe, Qwen2Config, Qwen2ForCausalLM),
        ("llama", unigram, LlamaConfig, LlamaForCausalLM),
    ):
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
            clean_up_tokenization_spaces=False,
        )  # fmt: skip
        config = config_class(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        torch.manual_seed(1)
        model = model_class(config)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = root / name
    return paths


@pytest.fixture(scope="session")
def qwen2_llama_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``build_qwen2_llama_pair`` once per session."""
    return build_qwen2_llama_pair(tmp_path_factory.mktemp("qwen2-llama"))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny heterogeneous checkpoints (hidden 32, 2 heads), loaded by path as real ones are."""
    return build_checkpoints(tmp_path_factory.mktemp("checkpoints"), hidden=32, heads=2)


@pytest.fixture(scope="session")
def fresh_embedded_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty model cache for the slow tier's full warm-starts, shared by its tests: the default
    pair is warm-started once per session, by the code under test, from random init (the
    provenance test checks those weights byte for byte; the full demo then reuses them)."""
    return tmp_path_factory.mktemp("embedded-cache")


def task_of(base: dict, problems: list, settings, provenance: dict, name: str = "tiny") -> CompareTask:
    """An embedded-like compare task from its parts: ``base`` (raw config), the held-out
    ``problems`` evaluated with ``settings.eval_samples`` samples, keyed by their ids."""
    from graftrl.embedded.base import HELDOUT
    from graftrl.evaluation.benchmarks import Benchmark
    from graftrl.experiments.compare.task import CompareTask, Evaluation

    evaluation = Evaluation((Benchmark(HELDOUT, list(problems), "held-out"),), settings.eval_samples, False)
    return CompareTask(name, base, evaluation, provenance, settings)


@pytest.fixture
def tiny_task(tiny_checkpoints: dict[str, Path]) -> CompareTask:
    """compare's task on the tiny random checkpoints and the fixture problems: cells take seconds."""
    from graftrl.embedded.base import DemoSettings
    from graftrl.reporting.provenance import results_provenance
    from graftrl.storage.data import load_problems

    base = make_config(tiny_checkpoints, steps=1)
    del base["method"], base["seed"]
    settings = DemoSettings(
        steps=1, batch_prompts=4, minibatch_prompts=2, n=4, max_new_tokens=8, n_eval=3, eval_samples=2
    )
    problems = load_problems(FIXTURES / "math_small.jsonl")[:3]
    return task_of(base, problems, settings, results_provenance(tiny_checkpoints))


@pytest.fixture(scope="session")
def vllm_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same with 32-wide attention heads, the smallest vLLM's CPU kernels run."""
    return build_checkpoints(tmp_path_factory.mktemp("vllm_checkpoints"), hidden=64, heads=2)


@pytest.fixture(autouse=True)
def _logged_metric_keys_are_declared(monkeypatch: pytest.MonkeyPatch):
    """Every metrics key a test's training logs must be declared, in graftrl.storage.log_keys.METRIC_KEYS
    or by its method's loss_metrics (the schema behind docs/metrics.md and the sinks,
    ``training.log_schema.metric_keys``); a new metric without a declaration fails here."""
    from graftrl.storage.log_keys import undeclared_keys
    from graftrl.storage.metrics import MetricsLogger
    from graftrl.training.log_schema import metric_keys

    undeclared: set[str] = set()
    original = MetricsLogger.log

    def log(self: MetricsLogger, row: dict) -> None:
        undeclared.update(undeclared_keys([row], metric_keys()))
        original(self, row)

    monkeypatch.setattr(MetricsLogger, "log", log)
    yield
    assert not undeclared, (
        f"metrics keys logged but declared neither in graftrl.storage.log_keys.METRIC_KEYS nor by a method's "
        f"loss_metrics: {sorted(undeclared)}; "
        "declare them and regenerate docs/metrics.md (graftrl metrics-reference --markdown)"
    )


@pytest.fixture
def ray_ships_test_helpers():
    """Ray actors cannot import the test modules: ship conftest's classes (verifiers) by value for
    one test. Only for that test: by value, a class cannot be pickled again by reference, which the
    FSDP rank processes an actor spawns need (tests/test_data_parallel.py)."""
    import sys

    import ray

    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    yield
    ray.cloudpickle.unregister_pickle_by_value(module)
