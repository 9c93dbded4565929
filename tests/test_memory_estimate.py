"""The per-GPU memory estimate: arithmetic by hand, parameter counts of real models, the start-up
check (refuses on CUDA before loading, never on CPU) and `graftrl estimate-memory`."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import CONFIGS, make_config
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from graftrl.cli import app
from graftrl.config import config_from_dict, load_config
from graftrl.models import memory
from graftrl.models.memory import (
    GIB,
    MemoryEstimateError,
    ModelShape,
    check_before_loading,
    data_parallel_size,
    estimate_config,
    estimate_policy,
    model_shape,
)

# Qwen3-1.7B-Base's shape (its config.json): hidden 2048, 28 layers, MLP 6144, vocab 151,936.
SHAPE = ModelShape(parameters=1_720_574_976, hidden=2048, layers=28, intermediate=6144, vocab=151_936)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_parameter_count_from_config_matches_the_loaded_model(tiny_checkpoints, arch):
    shape = model_shape(str(tiny_checkpoints[arch]))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoints[arch]))
    assert shape.parameters == sum(p.numel() for p in model.parameters())  # tied embedding once
    assert (shape.hidden, shape.layers, shape.vocab) == (
        model.config.hidden_size,
        model.config.num_hidden_layers,
        model.config.vocab_size,
    )


def config_with(**train) -> object:
    raw = {
        "method": "grpo",
        "policies": [{"name": "q", "path": "unused", "dtype": "bfloat16"}],
        "data": {"train": "t.jsonl"},
        "rollout": {"max_new_tokens": 4096},
        "train": {"micro_batch_size": 8, **train},
    }
    return config_from_dict(raw)


def test_estimate_by_hand():
    config = config_with()
    spec = config.policies[0]
    e = estimate_policy(config, spec, SHAPE, device_bytes=141 * GIB, prompt_tokens=512, ranks=4)
    p = SHAPE.parameters
    assert e.model_states == 4 * p * 4 / 4  # fp32 weights, grads, m, v over 4 ranks
    assert e.compute_copy == p * 2 / 4  # bf16 autocast copy
    tokens = 8 * (512 + 4096)
    assert e.activations == tokens * 28 * (11 * 2048 + 4 * 6144) * 2
    # the figure: 8 rows x 4,096 positions x 151,936 fp32 logits ~ 20 GB, plus the
    # bf16 head output and the fp32 log-softmax
    assert pytest.approx(19.9e9, rel=1e-2) == 8 * 4096 * 151_936 * 4
    assert e.logits == 8 * 4096 * 151_936 * (2 + 4 + 4)
    assert e.vllm == 0 and e.peak == e.model_states + e.compute_copy + e.activations + e.logits

    saved = estimate_policy(
        config_with(gradient_checkpointing=True, logprob_chunk_tokens=1024, micro_batch_tokens=16384),
        spec,
        SHAPE,
        device_bytes=141 * GIB,
        prompt_tokens=512,
        ranks=4,
    )
    rows = 16384 // 4608  # full-length rows within the token budget: 3
    assert saved.activations == rows * 4608 * (28 * 2048 * 4 + (11 * 2048 + 4 * 6144) * 2)
    assert saved.logits == rows * 1024 * 151_936 * 10
    assert saved.peak < e.peak / 3


def test_hf_generation_by_hand():
    """The HF engine's KV cache of max_batch_size full-length rows, one step's logits and, when
    sharded, the gathered compute-dtype weights; it never coincides with the update."""
    shape = dataclasses.replace(SHAPE, kv_width=8 * 128)  # 8 KV heads of 128
    raw = config_with().model_dump()
    raw["rollout"]["max_batch_size"] = 64
    config = config_from_dict(raw)
    e = estimate_policy(config, config.policies[0], shape, device_bytes=141 * GIB, prompt_tokens=512, ranks=4)
    kv = 64 * (512 + 4096) * 2 * 28 * 1024 * 2  # rows x tokens x (K, V) x layers x width x bf16
    assert e.generation == kv + 64 * 151_936 * 4 * 2 + SHAPE.parameters * 2 * 3 / 4
    assert e.peak == e.resident + max(e.update, e.generation)
    one = estimate_policy(
        config, config.policies[0], shape, device_bytes=141 * GIB, prompt_tokens=512, ranks=1
    )
    assert one.generation == kv + 64 * 151_936 * 4 * 2  # unsharded: the weights are already there


def test_vllm_share_and_sleep():
    raw = config_with().model_dump()
    raw["rollout"].update(engine="vllm", vllm={**raw["rollout"]["vllm"], "gpu_memory_utilization": 0.3})
    config = config_from_dict(raw)
    e = estimate_policy(config, config.policies[0], SHAPE, device_bytes=100 * GIB, ranks=1)
    assert e.vllm == pytest.approx(30 * GIB) and e.vllm_sleeps
    assert e.peak == e.resident + max(e.update, e.vllm)
    raw["rollout"]["vllm"]["sleep"] = False
    awake = config_from_dict(raw)
    e = estimate_policy(awake, awake.policies[0], SHAPE, device_bytes=100 * GIB, ranks=1)
    assert e.peak == e.resident + e.update + e.vllm


def test_colocated_policies_add_their_states(tiny_checkpoints):
    config = config_from_dict(make_config(tiny_checkpoints))  # backend local: one device
    estimates, total = estimate_config(config, 141 * GIB)
    # one policy samples or updates at a time: the larger of the biggest update and generation
    transient = max(max(e.update for e in estimates), max(e.generation for e in estimates))
    assert total == pytest.approx(sum(e.resident for e in estimates) + transient)
    assert [e.parameters for e in estimates] == [
        model_shape(str(tiny_checkpoints[name])).parameters for name in ("llama", "gpt2")
    ]


def test_data_parallel_size_reads_the_parallel_section_when_present():
    assert data_parallel_size(SimpleNamespace()) == 1
    assert data_parallel_size(SimpleNamespace(parallel=SimpleNamespace(data=4))) == 4


def test_startup_check_refuses_on_cuda_before_loading(tiny_checkpoints, tmp_path, monkeypatch):
    from graftrl.models import policy as policy_module
    from graftrl.training.trainer import Trainer

    config = config_from_dict(make_config(tiny_checkpoints))
    check_before_loading(config)  # CPU: never refuses
    monkeypatch.setattr(policy_module, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 80 * GIB))

    def no_loading(*args, **kwargs):
        raise AssertionError("weights loaded before the memory check")

    monkeypatch.setattr(policy_module.Policy, "from_pretrained", no_loading)
    with pytest.raises(
        MemoryEstimateError, match=r"exceeds the 0\.0 GiB available: raise policies\[\]\.parallel\.data"
    ):
        Trainer(config, tmp_path / "run")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GIB, 80 * GIB))
    check_before_loading(config)  # fits: prints the table, no error


def test_estimate_memory_cli(tiny_checkpoints, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(make_config(tiny_checkpoints)))
    runner = CliRunner()
    result = runner.invoke(app, ["estimate-memory", str(path), "--gpu-memory", "80"])
    assert result.exit_code == 0, result.output
    assert "llama" in result.output and "gpt2" in result.output and "fits:" in result.output
    result = runner.invoke(app, ["estimate-memory", str(path), "--gpu-memory", "0.000001"])
    assert result.exit_code == 1 and "does not fit" in result.output
    result = runner.invoke(
        app, ["estimate-memory", str(path), "--set", f"policies.0.path={tmp_path / 'missing'}"]
    )
    assert result.exit_code == 2 and "cannot read the model config" in result.output


# Shapes of the scale configs' models, from their public config.json files (no download here).
PUBLIC_SHAPES = {
    "smollm3": ModelShape(3_075_098_624, 2048, 36, 11008, 128_256),
    "qwen3": SHAPE,
    "qwen3-8b": ModelShape(8_190_735_360, 4096, 36, 12288, 151_936),
    "octothinker-8b": ModelShape(8_030_261_248, 4096, 32, 14336, 128_256),
}


@pytest.mark.parametrize("name", ["pair1-graft-4gpu.yaml", "graft-8b-8gpu.yaml"])
def test_scale_configs_fit_an_h200_by_the_estimate(name, monkeypatch):
    config = load_config(CONFIGS / name)
    if not any(hasattr(p, "parallel") for p in config.policies):  # before the FSDP merge: N = 4 / 8
        ranks = 4 if "4gpu" in name else 8
        monkeypatch.setattr(memory, "data_parallel_size", lambda spec: ranks)
    shapes = {p.name: PUBLIC_SHAPES[p.name] for p in config.policies}
    _, total = estimate_config(config, 141 * GIB, shapes=shapes)
    assert total < 141 * GIB


def _saved_for_backward(model, ids, dtype) -> int:
    """Bytes of the distinct storages autograd saves during one training forward."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return sum(storages.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eager_attention_adds_the_saved_probabilities_autograd_keeps(tiny_checkpoints, dtype):
    """`attn_implementation: eager` materialises every layer's rows x heads x L² probabilities for
    backward; the estimate's extra term is what autograd really saves over SDPA (within 3%)."""
    path = str(tiny_checkpoints["llama"])
    shape = model_shape(path)
    rows, prompt, response = 3, 16, 80
    ids = torch.randint(0, shape.vocab, (rows, prompt + response), generator=torch.Generator().manual_seed(0))
    compute = None if dtype == "float32" else torch.bfloat16
    saved = {}
    for kernel in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=kernel).train()
        saved[kernel] = _saved_for_backward(model, ids, compute)

    def estimate(kernel):
        raw = make_config(tiny_checkpoints, micro_batch_size=rows)
        raw["policies"][0].update(dtype=dtype, attn_implementation=kernel)
        raw["rollout"]["max_new_tokens"] = response
        config = config_from_dict(raw)
        return estimate_policy(config, config.policies[0], shape, device_bytes=GIB, prompt_tokens=prompt)

    extra = estimate("eager").activations - estimate(None).activations
    assert extra == rows * shape.heads * (prompt + response) ** 2 * shape.layers * (
        4 if compute is None else 6
    )
    assert extra == pytest.approx(saved["eager"] - saved["sdpa"], rel=0.03)
