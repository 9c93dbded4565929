"""Rollout throughput: tokens/s and rows/s of HFRolloutEngine and (when importable) VLLMRolloutEngine.

Both engines sample the same prompts with the same model, batch, n, max new tokens and sampling
settings, through graftrl's engine contract (``generate(policy, problems, params, seed)`` ->
RolloutBatch with behaviour log-probs), ``--warmup`` untimed calls first, then ``--repeats``
timed calls. Generated tokens count every sampled token (a terminal EOS included). For vLLM the
engine start and a weight sync (``sync_weights``, done after every optimizer update in training)
are timed too.

vLLM lives in its own environment (it pins its own transformers); run the script with that
interpreter to get both engines, with graftrl's source on the path:

    PYTHONPATH=src .venv-vllm/bin/python benchmarks/rollout_throughput.py --prompts 64 --n 8
    PYTHONPATH=src .venv/bin/python benchmarks/rollout_throughput.py          # HF only (says why)
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default="llama-char", help="embedded spec name (llama-char, gpt2-bpe) or a model folder"
    )
    ap.add_argument(
        "--template", default="{problem}=", help="prompt template ('{problem}=' for the embedded models)"
    )
    ap.add_argument("--prompts", type=int, default=32, help="prompts per generate call")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--max-batch-size", type=int, default=512, help="HF engine rows per generate call")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--vllm-kv-cache-gib", type=float, default=None, help="CPU backend KV cache (GiB)")
    ap.add_argument("--vllm-max-model-len", type=int, default=None)
    ap.add_argument(
        "--vllm-cuda-graphs", action="store_true", help="enforce_eager=False (capture CUDA graphs)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def resolve_model(args) -> Path:
    if Path(args.model).is_dir():
        return Path(args.model)
    paths = C.embedded_paths(args.cache_dir)
    if args.model not in paths:
        raise SystemExit(f"--model {args.model!r}: not a folder nor one of {sorted(paths)}")
    return paths[args.model]


def problems_for(args) -> list[str]:
    from graftrl.embedded.task import make_split

    train, _ = make_split(seed=0, n_train=max(args.prompts, 1200), n_eval=256)
    return [p.problem for p in train[: args.prompts]]


def vllm_engine(policy, args):
    """(engine, start seconds) or (None, reason)."""
    try:
        from graftrl.models.rollout_vllm import VLLMOptions, VLLMRolloutEngine
    except Exception as error:  # ImportError, or vllm failing at import (e.g. torchvision mismatch)
        return None, f"{type(error).__name__}: {error}"
    wanted = {
        "gpu_memory_utilization": args.vllm_gpu_memory_utilization,
        "kv_cache_space_gib": args.vllm_kv_cache_gib,
        "max_model_len": args.vllm_max_model_len,
        "enforce_eager": False if args.vllm_cuda_graphs else None,
    }
    fields = (
        {f.name for f in dataclasses.fields(VLLMOptions)} if dataclasses.is_dataclass(VLLMOptions) else set()
    )
    if not fields:  # pydantic or plain class: pass what its signature takes
        fields = set(inspect.signature(VLLMOptions).parameters)
    options = VLLMOptions(**{k: v for k, v in wanted.items() if v is not None and k in fields})
    start = time.perf_counter()
    engine = VLLMRolloutEngine(policy, options, seed=args.seed)
    return engine, time.perf_counter() - start


def measure(engine, policy, problems, params, args, sync) -> dict[str, Any]:
    accepts_seed = "seed" in inspect.signature(engine.generate).parameters

    def call(seed: int):
        if accepts_seed:
            return engine.generate(policy, problems, params, seed=seed)
        return engine.generate(policy, problems, params)

    for i in range(args.warmup):
        call(args.seed + 1000 + i)
    times, tokens, rows, finished = [], [], [], []
    for i in range(args.repeats):
        sync()
        start = time.perf_counter()
        batch = call(args.seed + i)
        sync()
        times.append(time.perf_counter() - start)
        tokens.append(sum(len(r) for r in batch.response_ids))
        rows.append(len(batch.response_ids))
        finished.append(sum(batch.finished) / max(len(batch.finished), 1))
    total_t = sum(times)
    return {
        "call_s_median": C.median(times),
        "tokens_per_s": sum(tokens) / total_t,
        "rows_per_s": sum(rows) / total_t,
        "mean_response_tokens": sum(tokens) / sum(rows),
        "finished_frac": C.mean(finished),
        "calls": len(times),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    C.set_threads(args.threads)
    C.quiet_hf()
    note = C.contention_note(args.threads)
    import torch

    from graftrl.models.policy import Policy
    from graftrl.models.rollout import HFRolloutEngine, SamplingParams

    info = C.machine_info()
    model_path = resolve_model(args)
    policy = Policy.from_pretrained(
        "policy", str(model_path), dtype=args.dtype, device=args.device, template=args.template
    )
    policy.temperature = args.temperature
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens
    )
    problems = problems_for(args)
    cuda = policy.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results: dict[str, Any] = {}
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if "hf" in engines:
        results["hf"] = measure(HFRolloutEngine(args.max_batch_size), policy, problems, params, args, sync)
        if cuda:
            results["hf"]["cuda_max_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    vllm_note = None
    if "vllm" in engines:
        engine, started = vllm_engine(policy, args)
        if engine is None:
            vllm_note = f"vLLM engine not measured: graftrl.models.rollout_vllm is not importable here ({started})."
        else:
            try:
                results["vllm"] = measure(engine, policy, problems, params, args, sync)
                results["vllm"]["engine_start_s"] = started
                syncs = []
                for _ in range(3):
                    start = time.perf_counter()
                    engine.sync_weights(policy)
                    sync()
                    syncs.append(time.perf_counter() - start)
                results["vllm"]["sync_weights_s"] = C.median(syncs)
            finally:
                engine.close()
    if note:
        print(note)
    rows = []
    for name, r in results.items():
        rows.append(
            [
                name,
                r["tokens_per_s"],
                r["rows_per_s"],
                r["call_s_median"],
                r["mean_response_tokens"],
                r["finished_frac"],
                r.get("engine_start_s"),
                r.get("sync_weights_s"),
            ]
        )
    print(
        C.table(
            [
                "engine",
                "tokens/s",
                "rows/s",
                "call s (median)",
                "tokens/row",
                "finished",
                "start s",
                "sync_weights s",
            ],
            rows,
            title=(
                f"{model_path.name}: {args.prompts} prompts x n={args.n}, max_new_tokens={args.max_new_tokens}, "
                f"T={args.temperature}, top-p={args.top_p}, {args.dtype} on {policy.device}, threads={args.threads}; "
                f"{args.repeats} timed calls after {args.warmup} warm-up"
            ),
        )
    )
    if "hf" in results and "vllm" in results:
        print(f"vLLM / HF tokens/s: {C.fmt(results['vllm']['tokens_per_s'] / results['hf']['tokens_per_s'])}")
    if vllm_note:
        print(vllm_note)
        print(
            "  (run under the vLLM environment, .venv-vllm/bin/python from scripts/setup_vllm.sh, with PYTHONPATH=src)"
        )
    payload = {
        "args": vars(args),
        "machine": info,
        "contention": note,
        "results": results,
        "vllm_note": vllm_note,
    }
    C.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
