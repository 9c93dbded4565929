"""A graftrl GRPO step at ~0.5B scale in bf16 on a CUDA machine (no hub needed): time and memory.

Builds a random-init Qwen2-style model from a transformers config (default: Qwen2.5-0.5B's
shape — hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864, vocab 151,936, tied embeddings)
and a byte-level BPE tokenizer trained locally with ``tokenizers`` on generated text, saves both
with ``save_pretrained``, loads them through ``graftrl.models.policy.Policy.from_pretrained(...,
dtype="bfloat16", device="cuda")`` (bf16 autocast, fp32 master weights and AdamW state) and runs
graftrl's Trainer (method grpo) on it:

- rollout (HF ``generate``; and vLLM through ``rollout.engine: vllm`` when importable),
- reward: a stand-in verifier drawing 0/1 rewards at random (a random model never answers
  right, and all-zero rewards would leave nothing to train: zero-advantage rows are skipped),
- update (4 optimizer steps per batch at the defaults),
- a separate log-prob pass (``Policy.score``, no grad) over the last step's responses: the cost
  of GRAFT's peer scoring, or of an old-log-prob pass, per token.

It prints the step breakdown, tokens/s of each phase and the CUDA memory peak
(``torch.cuda.max_memory_allocated``) per step. A random model rarely samples EOS, so every
response runs to ``--max-new-tokens``: the figures are for full-length responses.

    PYTHONPATH=src python benchmarks/gpu_step.py                       # CUDA, ~0.5B, bf16
    PYTHONPATH=src python benchmarks/gpu_step.py --engines hf,vllm     # also the vLLM engine
    PYTHONPATH=src python benchmarks/gpu_step.py --tiny                # CPU smoke test, small dims
    PYTHONPATH=src python benchmarks/gpu_step.py --max-new-tokens 4096 --gradient-checkpointing \
        --logprob-chunk-tokens 1024 --micro-batch-tokens 16384      # paper lengths, memory features on
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

FULL = {
    "hidden": 896,
    "layers": 24,
    "heads": 14,
    "kv_heads": 2,
    "intermediate": 4864,
    "vocab": 151936,
    "tokenizer_vocab": 32000,
    "batch_prompts": 32,
    "n": 8,
    "max_new_tokens": 512,
    "minibatch_prompts": 8,
    "micro_batch_size": 32,
    "prompt_words": 40,
    "steps": 3,
    "warmup": 1,
    "device": "cuda",
    "dtype": "bfloat16",
}
TINY = {
    "hidden": 64,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "intermediate": 128,
    "vocab": 2048,
    "tokenizer_vocab": 1024,
    "batch_prompts": 4,
    "n": 4,
    "max_new_tokens": 16,
    "minibatch_prompts": 2,
    "micro_batch_size": 8,
    "prompt_words": 8,
    "steps": 2,
    "warmup": 1,
    "device": "cpu",
    "dtype": "float32",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small dims on CPU (a smoke test of the script)")
    ap.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"])
    for key, value in FULL.items():
        ap.add_argument(
            "--" + key.replace("_", "-"),
            type=type(value),
            default=None,
            help=f"default {value} (--tiny: {TINY[key]})",
        )
    ap.add_argument(
        "--engines", default="hf,vllm", help="rollout engines to run the step with (vllm: when importable)"
    )
    ap.add_argument("--lr", type=float, default=1e-6)
    # Memory features (train.*); off by default, so figures stay comparable with earlier runs.
    ap.add_argument("--gradient-checkpointing", action="store_true", help="train.gradient_checkpointing")
    ap.add_argument("--logprob-chunk-tokens", type=int, default=None, help="train.logprob_chunk_tokens")
    ap.add_argument("--micro-batch-tokens", type=int, default=None, help="train.micro_batch_tokens")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--vllm-sleep", default="auto", choices=["auto", "on", "off"])
    ap.add_argument(
        "--build-only", action="store_true", help="build (or find) the model folder, print its path, exit"
    )
    ap.add_argument(
        "--model-dir",
        default=None,
        help="where to build/reuse the model (default: a cache folder keyed by the dims)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    base = TINY if args.tiny else FULL
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# ----- model and tokenizer ------------------------------------------------------------------------
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _words(rng: random.Random, count: int) -> list[str]:
    return ["".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 9))) for _ in range(count)]


def build_tokenizer(vocab_size: int, seed: int):
    """Byte-level BPE trained on generated text (pseudo-words and arithmetic), specials pad/bos/eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    words = _words(rng, max(2000, vocab_size * 2))

    def corpus():
        for _ in range(max(2000, vocab_size // 2)):
            yield (
                " ".join(rng.choice(words) for _ in range(30))
                + f" {rng.randint(0, 999)}+{rng.randint(0, 99)}="
            )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        clean_up_tokenization_spaces=False,
    )


def build_model_dir(args) -> Path:
    """Build (or reuse) the random-init model + tokenizer folder; returns its path."""
    import torch

    dims = {
        k: getattr(args, k)
        for k in (
            "arch",
            "hidden",
            "layers",
            "heads",
            "kv_heads",
            "intermediate",
            "vocab",
            "tokenizer_vocab",
            "seed",
        )
    }
    key = hashlib.sha1(json.dumps(dims, sort_keys=True).encode()).hexdigest()[:12]
    folder = (
        Path(args.model_dir)
        if args.model_dir
        else Path.home() / ".cache" / "graftrl" / "bench" / f"{args.arch}-{key}"
    )
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    start = time.perf_counter()
    print(f"building {args.arch} (hidden {args.hidden}, {args.layers} layers) in {folder}", flush=True)
    tokenizer = build_tokenizer(args.tokenizer_vocab, args.seed)
    # The model's vocabulary may be wider than the tokenizer's (as Qwen's is); ids past the
    # tokenizer decode to nothing, which changes no timing.
    vocab = max(args.vocab, len(tokenizer))
    common = dict(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rms_norm_eps=1e-6,
    )
    if args.arch == "qwen2":
        from transformers import Qwen2Config as Config
        from transformers import Qwen2ForCausalLM as Model
    else:
        from transformers import LlamaConfig as Config
        from transformers import LlamaForCausalLM as Model
    torch.manual_seed(args.seed)
    model = Model(Config(**common))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder)  # bf16 on disk; loaded back as fp32 masters
    tokenizer.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    (folder / "bench_model.json").write_text(json.dumps({**dims, "vocab": vocab, "parameters": params}))
    print(
        f"built {args.arch} with {params / 1e6:.1f}M parameters (vocab {vocab}) in {time.perf_counter() - start:.1f}s: {folder}"
    )
    return folder


# ----- the run --------------------------------------------------------------------------------------
def make_problems(args):
    from graftrl.storage.data import MathProblem

    rng = random.Random(args.seed)
    words = _words(rng, 5000)
    out = []
    for i in range(args.batch_prompts * (args.warmup + args.steps + 1)):
        filler = " ".join(rng.choice(words) for _ in range(args.prompt_words))
        a, b = rng.randint(10, 999), rng.randint(1, 99)
        out.append(MathProblem(f"p{i}", f"{filler} {a}+{b}=", str(a + b)))
    return out


def memory_settings(args) -> dict[str, Any]:
    """The train.* memory fields given on the command line (none: the row-count path as before)."""
    settings: dict[str, Any] = {}
    if args.gradient_checkpointing:
        settings["gradient_checkpointing"] = True
    if args.logprob_chunk_tokens:
        settings["logprob_chunk_tokens"] = args.logprob_chunk_tokens
    if args.micro_batch_tokens:
        settings["micro_batch_tokens"] = args.micro_batch_tokens
    return settings


def run_engine(args, model_dir: Path, engine: str, problems) -> dict[str, Any]:
    import torch

    from graftrl.config import config_from_dict
    from graftrl.models.policy import Policy
    from graftrl.storage.rundir import read_metrics
    from graftrl.training.trainer import Trainer

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    policy = Policy.from_pretrained(
        "policy", str(model_dir), dtype=args.dtype, device=args.device, template="{problem}"
    )
    total = args.warmup + args.steps
    rollout: dict[str, Any] = {"engine": engine}
    if engine == "vllm":
        vllm = {"gpu_memory_utilization": args.vllm_gpu_memory_utilization}
        if args.vllm_sleep != "auto":
            vllm["sleep"] = args.vllm_sleep == "on"
        rollout["vllm"] = vllm
    raw = {
        "seed": args.seed,
        "method": "grpo",
        "policies": [
            {
                "name": "policy",
                "path": str(model_dir),
                "template": "{problem}",
                "dtype": args.dtype,
                "device": args.device,
            }
        ],
        "data": {"train": str(model_dir / "unused.jsonl"), "prompt_suffix": None},
        "rollout": {"n": args.n, "temperature": 1.0, "max_new_tokens": args.max_new_tokens, **rollout},
        "optim": {"lr": args.lr},
        "train": {
            "steps": total,
            "batch_prompts": args.batch_prompts,
            "minibatch_prompts": args.minibatch_prompts,
            "micro_batch_size": args.micro_batch_size,
            **memory_settings(args),
        },
        "logging": {"progress": False, "log_samples": 0},
        "checkpoint": {"every": 0, "keep_last": 1},
    }
    if engine == "hf":
        raw["rollout"].pop("engine")  # the default; works with Trainers that predate rollout.engine
    config = config_from_dict(raw)
    captured: dict[str, Any] = {}
    marks: list[float] = []
    memory: list[float] = []

    def callback(step: int, metrics) -> None:
        sync()
        marks.append(time.perf_counter())
        peak = ""
        if cuda:
            memory.append(torch.cuda.max_memory_allocated() / 2**20)
            torch.cuda.reset_peak_memory_stats()
            peak = f", CUDA peak {memory[-1]:,.0f} MB"
        # A line per step, so that a run stopped at a time limit still says how far it got.
        wall = marks[-1] - (marks[-2] if len(marks) > 1 else start)
        print(f"{engine} step {len(marks)}/{total}: {wall:.1f}s{peak}", flush=True)

    with tempfile.TemporaryDirectory(prefix="graftrl-gpu-step-") as tmp:
        start = time.perf_counter()
        trainer = Trainer(
            config,
            Path(tmp) / "run",
            problems=problems,
            policies=[policy],
            verifier=C.CoinVerifier(args.seed),
            step_callback=callback,
        )
        built = time.perf_counter() - start
        print(f"{engine}: trainer built in {built:.1f}s", flush=True)
        for worker in _workers(trainer):
            _capture(worker, captured)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        marks.clear()
        trainer.train()
        rows = read_metrics(Path(tmp) / "run")
    walls = [b - a for a, b in zip([start, *marks[:-1]], marks[: len(rows)], strict=False)]
    measured = rows[args.warmup :]
    result: dict[str, Any] = {"engine": engine, "trainer_init_s": built}
    for key in (
        "time_rollout",
        "time_reward",
        "time_update",
        "time_weight_sync",
        "time_step",
        "memory_peak_mb",
        "train_tokens",
        "response_length",
    ):
        result[key] = C.median(r.get(key) for r in measured)
    result["wall_step_s"] = C.median(walls[args.warmup :])
    result["cuda_max_allocated_mb_per_step"] = C.median(memory[args.warmup :]) if memory else None
    generated = captured.get("tokens", [])[args.warmup :]
    result["generated_tokens"] = C.median(generated)
    if result["generated_tokens"] and result["time_rollout"]:
        result["rollout_tokens_per_s"] = result["generated_tokens"] / result["time_rollout"]
    if result["train_tokens"] and result["time_update"]:
        result["update_tokens_per_s"] = result["train_tokens"] / result["time_update"]
    if result["generated_tokens"] and result["wall_step_s"]:
        result["step_tokens_per_s"] = result["generated_tokens"] / result["wall_step_s"]
    # The log-prob pass (no grad) over the last rollout: GRAFT's peer scoring / an old-log-prob pass.
    last = captured.get("last")
    if last is not None:
        prompts = [last.prompt_ids[r // last.n] for r in range(len(last.response_ids))]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(2):
            sync()
            start = time.perf_counter()
            policy.score(prompts, last.response_ids)
            sync()
            times.append(time.perf_counter() - start)
        tokens = sum(len(r) for r in last.response_ids)
        result["logprob_pass_s"] = min(times)
        result["logprob_tokens_per_s"] = tokens / min(times)
        result["logprob_cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    del trainer, policy
    if cuda:
        torch.cuda.empty_cache()
    return result


def _workers(trainer) -> list[Any]:
    try:
        workers = trainer.workers
    except AttributeError:
        workers = None
    if workers:
        return list(workers)

    class _Old:  # single-loop Trainer: one shared engine
        engine = trainer.engine

    return [_Old]


def _capture(worker, captured: dict[str, Any]) -> None:
    """Keep the last rollout batch and its generated-token count per step."""
    engine = worker.engine
    original = engine.generate

    def generate(policy, problems, params, *a, **k):
        batch = original(policy, problems, params, *a, **k)
        captured["last"] = batch
        captured.setdefault("tokens", []).append(sum(len(r) for r in batch.response_ids))
        return batch

    engine.generate = generate


def vllm_available() -> str | None:
    """None when the vLLM engine imports, else why not."""
    try:
        import vllm  # noqa: F401

        import graftrl.models.rollout_vllm  # noqa: F401
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def memory_note(args) -> str:
    settings = memory_settings(args)
    return (" (" + ", ".join(f"{k}={v}" for k, v in settings.items()) + ")") if settings else ""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        C.set_threads(args.threads)
    C.quiet_hf()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available() and not args.build_only:
        raise SystemExit("no CUDA device here: run with --tiny (CPU, small dims) or --device cpu")
    info = C.machine_info()
    model_dir = build_model_dir(args)
    if args.build_only:
        print(model_dir)
        return {"model_dir": str(model_dir)}
    meta_path = model_dir / "bench_model.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    problems = make_problems(args)
    results: dict[str, Any] = {}
    notes = []
    for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
        if engine == "vllm":
            why = vllm_available()
            if why:
                notes.append(f"vLLM engine not measured: not importable here ({why}).")
                continue
        start = time.perf_counter()
        results[engine] = run_engine(args, model_dir, engine, problems)
        print(f"{engine}: {args.warmup + args.steps} steps in {time.perf_counter() - start:.1f}s", flush=True)
    title = (
        f"{args.arch} {meta.get('parameters', 0) / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} layers, vocab "
        f"{meta.get('vocab', args.vocab)}), {args.dtype} on {args.device} ({info.get('cuda') or 'cpu'}); "
        f"{args.batch_prompts} prompts x n={args.n}, max_new_tokens={args.max_new_tokens}, "
        f"{args.batch_prompts // args.minibatch_prompts} optimizer steps of {args.minibatch_prompts * args.n} rows, "
        f"micro-batch {args.micro_batch_size}{memory_note(args)}; medians of {args.steps} steps after "
        f"{args.warmup} warm-up"
    )
    rows = [
        [
            name,
            r["time_rollout"],
            r["time_reward"],
            r["time_update"],
            r.get("time_weight_sync"),
            r["time_step"],
            r["wall_step_s"],
            r.get("logprob_pass_s"),
        ]
        for name, r in results.items()
    ]
    print(
        C.table(
            [
                "engine",
                "rollout s",
                "reward s",
                "update s",
                "weight sync s",
                "step s",
                "wall step s",
                "log-prob pass s",
            ],
            rows,
            title=title,
        )
    )
    rows = [
        [
            name,
            r.get("generated_tokens"),
            r.get("rollout_tokens_per_s"),
            r.get("update_tokens_per_s"),
            r.get("logprob_tokens_per_s"),
            r.get("step_tokens_per_s"),
            r.get("cuda_max_allocated_mb_per_step"),
            r.get("memory_peak_mb"),
            r.get("logprob_cuda_max_allocated_mb"),
        ]
        for name, r in results.items()
    ]
    print(
        C.table(
            [
                "engine",
                "tokens/step",
                "rollout tok/s",
                "update tok/s",
                "log-prob tok/s",
                "step tok/s",
                "CUDA max alloc MB/step",
                "memory_peak_mb (metrics)",
                "log-prob pass max alloc MB",
            ],
            rows,
        )
    )
    for note in notes:
        print(note)
    payload = {"args": vars(args), "machine": info, "model": meta, "results": results, "notes": notes}
    C.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
