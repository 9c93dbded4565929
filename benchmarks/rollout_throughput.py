"""Rollout throughput: tokens/s and rows/s of HFRolloutEngine and (when importable) VLLMRolloutEngine.

Both engines sample the same prompts with the same model, batch, n, max new tokens and sampling
settings, through graftrl's engine contract (``generate(policy, problems, params, seed)`` ->
RolloutBatch with behaviour log-probs), ``--warmup`` untimed calls first, then ``--repeats``
timed calls. Generated tokens count every sampled token (a terminal EOS included). For vLLM the
engine start and a weight sync (``sync_weights``, done after every optimizer update in training)
are timed too.

``hf`` is the HF engine with its preallocated KV cache (``HFRolloutEngine(preallocate_cache=True)``;
the engine's default takes it where ``models.rollout.preallocation_pays``), ``hf-dynamic`` the same
engine with ``generate``'s own DynamicCache (``HFRolloutEngine(preallocate_cache=False)``), and
``hf-plain`` plain ``generate``: its own cache and every prompt's forward pass repeated n times (the
sampler before issue 25, ``share_prompts=False``). The HF engines are timed alternately, call by
call, and their samples are checked to be identical to the first one's (same seeds, same ids,
log-probs and texts).

vLLM lives in its own environment (it pins its own transformers); run the script with that
interpreter to get both engines, with graftrl's source on the path:

    PYTHONPATH=src .venv-vllm/bin/python benchmarks/rollout_throughput.py --prompts 64 --n 8
    PYTHONPATH=src .venv/bin/python benchmarks/rollout_throughput.py          # HF only (says why)
    PYTHONPATH=src .venv/bin/python benchmarks/rollout_throughput.py --engines hf,hf-dynamic \
        --task worked --max-new-tokens 80 --threads 1                       # the KV cache, demo sizes
    PYTHONPATH=src .venv/bin/python benchmarks/rollout_throughput.py --engines hf-plain,hf-dynamic \
        --prompts 32 --threads 1                                            # the shared prompt prefill
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
    ap.add_argument(
        "--engines",
        default="hf,vllm",
        help="hf, hf-dynamic (generate's own cache), hf-plain (plain generate: no shared prompt prefill), vllm",
    )
    ap.add_argument(
        "--task", default=None, help="embedded task of the prompts and models (default: the original, arith)"
    )
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
    paths = C.embedded_paths(args.cache_dir, args.task)  # the task's own models (their context fits)
    if args.model not in paths:
        raise SystemExit(f"--model {args.model!r}: not a folder nor one of {sorted(paths)}")
    return paths[args.model]


def problems_for(args) -> list[str]:
    from graftrl.embedded.task import make_split

    task = {"task": args.task} if args.task else {}
    train, _ = make_split(seed=0, n_train=max(args.prompts, 1200), n_eval=256, **task)
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


HF_ENGINES: dict[str, dict[str, bool]] = {
    "hf": {"preallocate_cache": True},
    "hf-dynamic": {"preallocate_cache": False},
    "hf-plain": {"preallocate_cache": False, "share_prompts": False},
}
"""The HF engines by name, as ``HFRolloutEngine`` options."""


def identical_key(reference: str) -> str:
    return f"identical_to_{reference.replace('-', '_')}"


def measure(engine, policy, problems, params, args, sync) -> dict[str, Any]:
    return measure_alternating({"engine": engine}, policy, problems, params, args, sync)["engine"]


def measure_alternating(engines: dict[str, Any], policy, problems, params, args, sync) -> dict[str, Any]:
    """Each engine's figures, the engines called in turn (A B A B ...) so load drifts hit all alike."""
    import torch

    def call(engine, seed: int):
        if "seed" in inspect.signature(engine.generate).parameters:
            return engine.generate(policy, problems, params, seed=seed)
        return engine.generate(policy, problems, params)

    for i in range(args.warmup):
        for engine in engines.values():
            call(engine, args.seed + 1000 + i)
    figures = {
        name: {"times": [], "cpu": [], "faults": [], "tokens": [], "rows": [], "finished": []}
        for name in engines
    }
    samples: dict[str, list[Any]] = {name: [] for name in engines}
    for i in range(args.repeats):
        for name, engine in engines.items():
            f = figures[name]
            sync()
            start, cpu, faults = time.perf_counter(), time.process_time(), _page_faults()
            batch = call(engine, args.seed + i)
            sync()
            f["times"].append(time.perf_counter() - start)
            f["cpu"].append(time.process_time() - cpu)
            f["faults"].append(_page_faults() - faults)
            f["tokens"].append(sum(len(r) for r in batch.response_ids))
            f["rows"].append(len(batch.response_ids))
            f["finished"].append(sum(batch.finished) / max(len(batch.finished), 1))
            samples[name].append(batch)
    out = {}
    for name, f in figures.items():
        total_t = sum(f["times"])
        out[name] = {
            "call_s_median": C.median(f["times"]),
            "cpu_s_median": C.median(f["cpu"]),
            "page_faults_median": C.median(f["faults"]),
            "tokens_per_s": sum(f["tokens"]) / total_t,
            "rows_per_s": sum(f["rows"]) / total_t,
            "mean_response_tokens": sum(f["tokens"]) / sum(f["rows"]),
            "finished_frac": C.mean(f["finished"]),
            "calls": len(f["times"]),
        }
    *others, reference = [name for name in HF_ENGINES if name in samples] or [None]
    for name in others:  # each against the last HF engine of HF_ENGINES' order, the reference
        out[name][identical_key(reference)] = all(
            ours.response_ids == theirs.response_ids
            and ours.texts == theirs.texts
            and all(
                torch.equal(a, b)
                for a, b in zip(ours.behaviour_logprobs, theirs.behaviour_logprobs, strict=True)
            )
            for ours, theirs in zip(samples[name], samples[reference], strict=True)
        )
    return out


def _page_faults() -> int:
    """Minor page faults of this process so far (the kernel zero-filling memory malloc asked for)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    C.set_threads(args.threads)
    C.quiet_hf()
    from graftrl.machine import tune_allocator

    # graftrl's commands' malloc settings; GRAFTRL_MALLOC=default times under glibc's own.
    allocator = "graftrl's" if tune_allocator() else "glibc's default"
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
    hf = {
        name: HFRolloutEngine(args.max_batch_size, **options)
        for name, options in HF_ENGINES.items()
        if name in engines
    }
    if hf:
        results.update(measure_alternating(hf, policy, problems, params, args, sync))
        if cuda:
            results["hf"]["cuda_max_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    vllm_note = None
    if "vllm" in engines:
        engine, started = vllm_engine(policy, args)
        if engine is None:
            vllm_note = (
                f"vLLM engine not measured: graftrl.models.rollout_vllm is not importable here ({started})."
            )
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
                r.get("cpu_s_median"),
                r.get("page_faults_median"),
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
                "CPU s (median)",
                "page faults (median)",
                "tokens/row",
                "finished",
                "start s",
                "sync_weights s",
            ],
            rows,
            title=(
                f"{model_path.name}: {args.prompts} prompts x n={args.n}, max_new_tokens={args.max_new_tokens}, "
                f"T={args.temperature}, top-p={args.top_p}, {args.dtype} on {policy.device}, threads={args.threads}; "
                f"{args.repeats} timed calls after {args.warmup} warm-up; malloc settings {allocator}"
            ),
        )
    )
    *others, reference = [name for name in HF_ENGINES if name in results] or [None]
    for name in others:
        ours, theirs = results[name], results[reference]
        print(
            f"{name} / {reference}: call {C.fmt(ours['call_s_median'] / theirs['call_s_median'])}, "
            f"CPU {C.fmt(ours['cpu_s_median'] / theirs['cpu_s_median'])}; "
            f"samples identical: {ours[identical_key(reference)]}"
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
