"""Run under `torch.distributed.run --nproc_per_node 2` by test_memory_features: the chunked log-prob
on an FSDP2-sharded policy (gloo, CPU) gives the unchunked log-probs and gradients.

argv: one checkpoint folder per architecture. Rank 0 prints one JSON line per checkpoint.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from graftrl.models.policy import Policy


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for path in sys.argv[1:]:
        policy = Policy.from_pretrained("p", path, device="cpu")
        prompts = policy.encode_prompts(["1+2", "3+45 and more"])
        responses = [policy.encode_response("3", True), policy.encode_response("48 is it", False)]
        batch = policy.pad(prompts, responses)
        decoder = policy.model.get_decoder()
        for layer in getattr(decoder, "layers", None) or decoder.h:
            fully_shard(layer, mesh=mesh)
        fully_shard(policy.model, mesh=mesh)
        results = {}
        for chunk in (None, 2):
            policy.logprob_chunk_tokens = chunk
            policy.model.zero_grad(set_to_none=True)
            logp = policy.response_logprobs(batch)
            weights = torch.arange(logp.numel(), dtype=torch.float32).view_as(logp) * batch.response_mask
            (logp * weights).sum().backward()
            grads = {n: p.grad.full_tensor() for n, p in policy.model.named_parameters()}
            results[chunk] = (logp.detach(), grads, policy.chunks_logprobs)
        (logp_a, grads_a, _), (logp_b, grads_b, chunked) = results[None], results[2]
        mask = batch.response_mask
        row = {
            "path": path,
            "chunked": chunked,
            "logp_diff": float((logp_a - logp_b)[mask].abs().max()),
            "grad_diff": max(float((grads_a[n] - grads_b[n]).abs().max()) for n in grads_a),
            "grad_max": max(float(g.abs().max()) for g in grads_a.values()),
        }
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    # Both ranks leave together, and without tearing gloo down: destroying the group, or the
    # interpreter's own exit, has aborted a rank after the work was done ("terminate called
    # without an active exception", twice in CI, even after a barrier). The results are printed.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
