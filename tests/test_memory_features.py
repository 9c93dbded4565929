"""Memory features of the update: chunked log-probs, token-sized micro-batches, gradient checkpointing.

Each must leave the results as they were (within float tolerance): only memory and time change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import CROSSED, ScriptedRewards, make_config, weights_of
from transformers import AutoModelForCausalLM, AutoTokenizer

from graftrl.config import config_from_dict
from graftrl.core import chunked_token_logprobs, token_logprobs
from graftrl.errors import UserError
from graftrl.models.policy import Policy, token_micro_batches
from graftrl.models.rollout import HFRolloutEngine, SamplingParams
from graftrl.training.trainer import Trainer


# ----- the pure function ---------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_token_logprobs_equal_the_full_computation(chunk, temperature, with_bias):
    generator = torch.Generator().manual_seed(chunk)
    batch, length, hidden_size, vocab = 3, 16, 8, 37
    hidden = torch.randn(batch, length, hidden_size, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64)
    bias = torch.randn(vocab, generator=generator, dtype=torch.float64) if with_bias else None
    targets = torch.randint(0, vocab, (batch, length), generator=generator)
    upstream = torch.randn(batch, length, generator=generator, dtype=torch.float64)

    def value_and_grads(fn):
        leaves = [t.detach().requires_grad_() for t in (hidden, weight, *([bias] if with_bias else []))]
        out = fn(leaves[0], leaves[1], leaves[2] if with_bias else None)
        (out * upstream).sum().backward()
        return out.detach(), [leaf.grad for leaf in leaves]

    # Reference: the unchunked formula written out, in float64.
    def reference(h, w, b):
        logits = torch.nn.functional.linear(h, w, b) / temperature
        return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    expected, expected_grads = value_and_grads(reference)
    got, grads = value_and_grads(
        lambda h, w, b: chunked_token_logprobs(h, w, b, targets, temperature, chunk_tokens=chunk)
    )
    assert got.shape == (batch, length) and got.dtype == torch.float32
    # float32 softmax (as the model path): float32 tolerance against the float64 reference
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-5)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    # no grad: the same values (chunks without checkpointing)
    with torch.no_grad():
        plain = chunked_token_logprobs(hidden, weight, bias, targets, temperature, chunk_tokens=chunk)
    torch.testing.assert_close(plain, token_logprobs(hidden, weight, bias, targets, temperature))


def test_chunked_backward_recomputes_one_chunk_at_a_time():
    """Autograd keeps no chunk's [B, C, V] logits: each is rebuilt in backward (checkpointed)."""
    hidden = torch.randn(2, 12, 4, requires_grad=True)
    weight = torch.randn(50, 4, requires_grad=True)
    targets = torch.randint(0, 50, (2, 12))
    vocab_sized: list[tuple[int, ...]] = []

    def pack(tensor):
        if tensor.dim() == 3 and tensor.shape[-1] == 50:
            vocab_sized.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = chunked_token_logprobs(hidden, weight, None, targets, chunk_tokens=5)
    assert vocab_sized == []  # nothing vocab-sized saved for backward at the top level
    out.sum().backward()
    assert hidden.grad is not None and weight.grad is not None


def test_chunk_tokens_must_be_positive():
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_logprobs(
            torch.zeros(1, 2, 3), torch.zeros(4, 3), None, torch.zeros(1, 2).long(), 1.0, 0
        )


# ----- the policy ----------------------------------------------------------------------------------
def padded_batch(policy: Policy):
    """Prompts and responses of different lengths, so both paddings are exercised."""
    prompts = policy.encode_prompts(["1+2", "12+34 and some more words", "7"])
    responses = [
        policy.encode_response("\\boxed{3}", finished=True),
        policy.encode_response("The answer is \\boxed{46}.", finished=False),
        policy.encode_response("7", finished=True),
    ]
    return policy.pad(prompts, responses)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 3, 5, 4096])
def test_policy_chunked_logprobs_and_gradients_match(tiny_checkpoints, arch, temperature, chunk):
    policy = Policy.from_pretrained(arch, str(tiny_checkpoints[arch]), device="cpu", temperature=temperature)
    assert policy.chunks_logprobs is False
    batch = padded_batch(policy)
    upstream = torch.randn(batch.response_ids.shape, generator=torch.Generator().manual_seed(0))
    upstream = upstream * batch.response_mask

    def value_and_grads():
        policy.model.zero_grad(set_to_none=True)
        logp = policy.response_logprobs(batch)
        (logp * upstream).sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in policy.model.named_parameters()}

    expected, expected_grads = value_and_grads()
    policy.logprob_chunk_tokens = chunk
    assert policy.chunks_logprobs
    got, grads = value_and_grads()
    mask = batch.response_mask
    torch.testing.assert_close(got[mask], expected[mask], rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # no-grad scoring goes through the same path
    scored = policy.score(
        [
            row[row != policy.tokenizer.pad_token_id].tolist()
            for row in batch.input_ids[:1, : batch.prompt_width]
        ],
        [batch.response_ids[0, : int(mask[0].sum())].tolist()],
    )
    torch.testing.assert_close(scored[0], expected[0, : int(mask[0].sum())], rtol=1e-5, atol=1e-5)


def test_logit_transforming_models_keep_the_unchunked_path(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"])
    model = AutoModelForCausalLM.from_pretrained(path)
    model.config.final_logit_softcapping = 30.0  # as Gemma 2: logits are not the bare LM head's
    policy = Policy("softcap", model, AutoTokenizer.from_pretrained(path), logprob_chunk_tokens=4)
    assert policy.chunks_logprobs is False


# ----- gradient checkpointing ----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_gradient_checkpointing_recomputes_layers_and_keeps_results(tiny_checkpoints, arch):
    path = str(tiny_checkpoints[arch])
    plain = Policy.from_pretrained(arch, path, device="cpu")
    checkpointed = Policy.from_pretrained(arch, path, device="cpu", logprob_chunk_tokens=4)
    checkpointed.enable_gradient_checkpointing()
    calls = {"plain": 0, "checkpointed": 0}
    for key, policy in (("plain", plain), ("checkpointed", checkpointed)):
        # a submodule: HF checkpoints the layer's forward, inside its own hooks
        layer = policy.model.get_decoder().get_submodule("h.0.mlp" if arch == "gpt2" else "layers.0.mlp")

        def count(*_, key=key):
            calls[key] += 1

        layer.register_forward_pre_hook(count)
    results = []
    for policy in (plain, checkpointed):
        policy.model.train()
        logp = policy.response_logprobs(padded_batch(policy))
        logp.sum().backward()
        results.append((logp.detach(), [p.grad for p in policy.model.parameters()]))
    assert calls == {"plain": 1, "checkpointed": 2}  # the layer ran again in backward
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # generation (eval mode, KV cache) still works and samples the same tokens
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_new_tokens=6)
    engine = HFRolloutEngine()
    first = engine.generate(plain, ["1+2", "3+4"], params, seed=5)
    second = engine.generate(checkpointed, ["1+2", "3+4"], params, seed=5)
    assert second.response_ids == first.response_ids


# ----- token-sized micro-batches -------------------------------------------------------------------
def test_token_micro_batches_pack_within_the_budget():
    shapes = [(2, 1), (2, 3), (3, 3), (1, 6), (4, 6), (10, 20), (2, 2)]
    groups = token_micro_batches(shapes, max_tokens=16)
    assert [k for g in groups for k in g] == list(range(len(shapes)))  # every row once, in order
    for group in groups:
        size = len(group) * (max(shapes[k][0] for k in group) + max(shapes[k][1] for k in group))
        assert size <= 16 or len(group) == 1
    # by hand: 2x(2+3)=10, 3x(3+3)=18 > 16 -> new; (3,3)+(1,6): 2x(3+6)=18 -> new; (1,6)+(4,6): 2x10=20
    # -> new; (4,6) alone 10, +(10,20) 60 -> new; (10,20) over budget alone; (2,2) alone
    assert groups == [[0, 1], [2], [3], [4], [5], [6]]
    assert token_micro_batches(shapes, max_tokens=1000) == [list(range(len(shapes)))]
    assert token_micro_batches([], max_tokens=10) == []
    # an empty response still pads to one column (Policy.pad)
    assert token_micro_batches([(3, 0), (3, 0)], max_tokens=8) == [[0, 1]]


def test_policy_score_is_the_same_with_token_micro_batches(tiny_checkpoints):
    policy = Policy.from_pretrained("gpt2", str(tiny_checkpoints["gpt2"]), device="cpu", micro_batch_size=2)
    prompts = policy.encode_prompts(["1+2", "12+34", "7-3", "100+1000+7"])
    responses = [policy.encode_response(text, True) for text in ["3", "\\boxed{46}", "4 is it", "1107"]]
    by_rows = policy.score(prompts, responses)
    policy.micro_batch_tokens = 12
    shapes = [(len(p), len(r)) for p, r in zip(prompts, responses, strict=True)]
    assert len(policy.micro_batch_groups(shapes)) > 2
    by_tokens = policy.score(prompts, responses)
    for a, b in zip(by_tokens, by_rows, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def run_weights(paths: dict[str, Path], out: Path, method: str = "graft", **train) -> dict[str, torch.Tensor]:
    raw = make_config(paths, method, **train)
    raw["optim"]["lr"] = 1e-3
    trainer = Trainer(config_from_dict(raw), out, verifier=ScriptedRewards(CROSSED))
    trainer.train()
    return weights_of(trainer)


@pytest.mark.parametrize("method", ["graft", "hacpo"])
def test_memory_features_leave_the_update_unchanged(tiny_checkpoints, tmp_path, method):
    """Two GRAFT (or HACPO) steps: the same weights with rows-, token-micro-batches, chunked
    log-probs and gradient checkpointing together, to float tolerance (lr 1e-3: a few 1e-5; HACPO's
    largest difference was 2.5e-5 on an AVX2 CPU, against weights that moved by 7.8e-3)."""
    extra = {"kl_coef": 1e-3} if method == "hacpo" else {}
    reference = run_weights(tiny_checkpoints, tmp_path / "rows", method, **extra)
    changed = run_weights(
        tiny_checkpoints,
        tmp_path / "tokens",
        method,
        micro_batch_tokens=40,
        logprob_chunk_tokens=3,
        gradient_checkpointing=True,
        **extra,
    )
    moved = max(float((reference[k] - w).abs().max()) for k, w in run_initial(tiny_checkpoints).items())
    assert moved > 1e-3  # the updates did move the weights
    for key, value in reference.items():
        torch.testing.assert_close(changed[key], value, rtol=0, atol=5e-5, msg=key)


def run_initial(paths: dict[str, Path]) -> dict[str, torch.Tensor]:
    out = {}
    for name in ("llama", "gpt2"):
        model = AutoModelForCausalLM.from_pretrained(str(paths[name]))
        out.update({f"{name}.{k}": v for k, v in model.state_dict().items()})
    return out


def test_gradient_checkpointing_unsupported_is_a_user_error(tiny_checkpoints):
    policy = Policy.from_pretrained("llama", str(tiny_checkpoints["llama"]), device="cpu")
    policy.model.supports_gradient_checkpointing = False
    with pytest.raises(UserError, match=r"train\.gradient_checkpointing"):
        policy.enable_gradient_checkpointing()


def test_a_model_that_cannot_chunk_warns_and_trains_unchunked(tiny_checkpoints, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoints["llama"]))
    model.config.final_logit_softcapping = 30.0
    model.save_pretrained(tmp_path / "softcap")
    AutoTokenizer.from_pretrained(str(tiny_checkpoints["llama"])).save_pretrained(tmp_path / "softcap")
    raw = make_config(
        {"llama": tmp_path / "softcap", "gpt2": tiny_checkpoints["gpt2"]}, logprob_chunk_tokens=4
    )
    with pytest.warns(UserWarning, match=r"policy 'llama' .* keeps the unchunked log-prob"):
        trainer = Trainer(config_from_dict(raw), tmp_path / "run", verifier=ScriptedRewards(CROSSED))
    assert [p.chunks_logprobs for p in trainer.policies] == [False, True]


def test_chunked_logprobs_under_fsdp2_match(tiny_checkpoints, tmp_path):
    """The chunked path calls the model itself (not its decoder), so FSDP2's hooks gather the
    sharded embedding and LM head: 2 gloo ranks on CPU, log-probs and gradients as unchunked."""
    import json
    import os
    import subprocess
    import sys

    script = Path(__file__).with_name("fsdp_chunked_logprobs.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    paths = [str(tiny_checkpoints["llama"]), str(tiny_checkpoints["gpt2"])]
    done = subprocess.run(
        [*command, str(script), *paths], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["path"] for row in rows] == paths
    for row in rows:
        assert row["chunked"] and row["logp_diff"] < 1e-5
        assert row["grad_diff"] < 1e-6 * max(row["grad_max"], 1.0) * 10


def test_an_unknown_logit_transform_is_caught_at_first_use(tiny_checkpoints):
    """Logits rescaled after the head with no config field naming it: the first chunked call
    compares the model's own last-column logits with the head's and falls back, with a warning."""
    policy = Policy.from_pretrained("llama", str(tiny_checkpoints["llama"]), device="cpu")
    policy.model.get_output_embeddings().register_forward_hook(lambda module, args, out: out * 2.0)
    batch = padded_batch(policy)
    expected = policy.response_logprobs(batch)
    policy.logprob_chunk_tokens = 3
    assert policy.chunks_logprobs
    with pytest.warns(UserWarning, match="logprob_chunk_tokens is ignored"):
        got = policy.response_logprobs(batch)
    assert not policy.chunks_logprobs
    torch.testing.assert_close(got, expected)
