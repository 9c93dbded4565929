"""Peak memory and time of one micro-batch's forward + backward vs response length, on a
151,936-token vocabulary: unchunked vs chunked log-probs (``train.logprob_chunk_tokens``), with and
without gradient checkpointing (``train.gradient_checkpointing``).

It builds a random-init Qwen2 model from a transformers config (vocab 151,936, tied embeddings;
small hidden size on CPU, Qwen2.5-0.5B's shape with ``--preset gpu``), wraps it in
``graftrl.models.policy.Policy`` and runs ``Policy.response_logprobs`` on ``--rows`` rows of
``--prompt-tokens`` + L random tokens, then backward of a token-mean loss: the path
``training.update.optimize`` takes for one micro-batch. Memory: on CUDA the allocator's peak
(``torch.cuda.max_memory_allocated``) above what was allocated before; on CPU the rise of the
process's peak RSS (VmHWM, reset through /proc/self/clear_refs after ``malloc_trim``) above the
RSS before. Each setting first runs once unmeasured (warm-up).

    PYTHONPATH=src python benchmarks/memory_vs_length.py                   # CPU, ~1-2 min
    PYTHONPATH=src python benchmarks/memory_vs_length.py --preset gpu      # CUDA, 0.5B, L up to 4,096
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

PRESETS = {
    "cpu": {
        "hidden": 64,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 256,
        "rows": 2,
        "prompt_tokens": 64,
        "lengths": "256,512,1024",
        "chunk": 128,
        "device": "cpu",
        "dtype": "float32",
        "repeats": 1,
    },
    "gpu": {
        "hidden": 896,
        "layers": 24,
        "heads": 14,
        "kv_heads": 2,
        "intermediate": 4864,
        "rows": 8,
        "prompt_tokens": 256,
        "lengths": "256,512,1024,2048,4096",
        "chunk": 1024,
        "device": "cuda",
        "dtype": "bfloat16",
        "repeats": 3,
    },
}
VOCAB = 151_936
SETTINGS = [  # (label, chunked log-probs, gradient checkpointing)
    ("unchunked", False, False),
    ("chunked", True, False),
    ("checkpointing", False, True),
    ("chunked + checkpointing", True, True),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    for key, value in PRESETS["cpu"].items():
        ap.add_argument("--" + key.replace("_", "-"), type=type(value), default=None)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def build_policy(args):
    """A random-init Qwen2 (tied embeddings) behind graftrl's Policy; a two-token tokenizer."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from graftrl.models.policy import Policy

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>")),
        pad_token="<pad>",
        eos_token="<eos>",
    )
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt_tokens + max(int(x) for x in args.lengths.split(",")),
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(args.device)
    compute = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype)
    policy = Policy("bench", model, tokenizer, compute_dtype=compute)
    policy.model.train()
    return policy


class Memory:
    """Peak memory above the starting point of a measurement (CUDA allocator, else VmHWM)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.rss = None if self.cuda else C.PeakRSS()
        try:
            self.libc = ctypes.CDLL("libc.so.6")
        except OSError:  # not glibc: freed heap pages may stay resident (figures then only rise)
            self.libc = None

    def start(self) -> None:
        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        if self.libc is not None:
            self.libc.malloc_trim(0)  # return freed heap pages, so the next peak starts low
        self.base = current_rss_mb()
        self.rss.reset()

    def peak_mb(self) -> float:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.base) / 2**20
        return self.rss.read_mb() - self.base


def current_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def step(policy, args, length: int) -> None:
    """One micro-batch: forward with grad, a token-mean loss, backward (as PolicyWorker does)."""
    import torch

    generator = torch.Generator().manual_seed(length)
    prompts = torch.randint(2, args.vocab, (args.rows, args.prompt_tokens), generator=generator).tolist()
    responses = torch.randint(2, args.vocab, (args.rows, length), generator=generator).tolist()
    batch = policy.pad(prompts, responses)
    logp = policy.response_logprobs(batch)  # [rows, length]
    loss = -(logp * batch.response_mask).sum() / batch.response_mask.sum()
    loss.backward()
    policy.model.zero_grad(set_to_none=True)


def measure(policy, args, length: int, memory: Memory) -> tuple[float, float]:
    import torch

    sync = torch.cuda.synchronize if memory.cuda else (lambda: None)
    step(policy, args, length)  # warm-up (allocator, kernels)
    peaks, times = [], []
    for _ in range(args.repeats):
        memory.start()
        start = time.perf_counter()
        step(policy, args, length)
        sync()
        times.append(time.perf_counter() - start)
        peaks.append(memory.peak_mb())
    return max(peaks), min(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    C.set_threads(args.threads)
    C.quiet_hf()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run the default CPU preset")
    info = C.machine_info()
    note = C.contention_note(args.threads)
    policy = build_policy(args)
    params = sum(p.numel() for p in policy.model.parameters())
    memory = Memory(args.device)
    lengths = [int(x) for x in args.lengths.split(",")]
    results: list[dict[str, Any]] = []
    for label, chunked, checkpointing in SETTINGS:
        policy.logprob_chunk_tokens = args.chunk if chunked else None
        if checkpointing:
            policy.enable_gradient_checkpointing()
        else:
            model = policy.model
            disable = (
                getattr(model, "activation_checkpointing_disable", None)
                or model.gradient_checkpointing_disable
            )
            disable()
        for length in lengths:
            try:
                peak, seconds = measure(policy, args, length, memory)
            except torch.cuda.OutOfMemoryError:  # a figure too: this setting does not fit at this length
                policy.model.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.empty_cache()
                results.append(
                    {"setting": label, "length": length, "peak_mb": None, "seconds": None, "oom": True}
                )
                print(f"{label:<24} L={length:<5} out of memory", flush=True)
                continue
            results.append({"setting": label, "length": length, "peak_mb": peak, "seconds": seconds})
            print(f"{label:<24} L={length:<5} peak {peak:9.1f} MB  {seconds:7.3f} s", flush=True)
        # after each setting, so a run stopped by a time limit keeps what it measured
        C.write_json(
            args.json, {"args": vars(args), "machine": info, "parameters": params, "results": results}
        )
    title = (
        f"Qwen2 random init, {params / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} layers, vocab "
        f"{args.vocab}), {args.dtype} on {info.get('cuda') or 'cpu'}, {args.threads} thread(s); one micro-batch "
        f"of {args.rows} rows x ({args.prompt_tokens} prompt + L response) tokens, forward + backward; "
        f"chunk {args.chunk} positions; peak memory above the start (MB) / seconds"
    )
    headers = ["L", *[f"{label} MB" for label, _, _ in SETTINGS], *[f"{label} s" for label, _, _ in SETTINGS]]
    by = {(r["setting"], r["length"]): r for r in results}

    def cell(label: str, length: int, key: str) -> Any:
        result = by[(label, length)]
        return "OOM" if result.get("oom") else result[key]

    rows = [
        [
            length,
            *[cell(label, length, "peak_mb") for label, _, _ in SETTINGS],
            *[cell(label, length, "seconds") for label, _, _ in SETTINGS],
        ]
        for length in lengths
    ]
    print(C.table(headers, rows, title=title))
    logits_mb = [args.rows * length * args.vocab * 4 / 2**20 for length in lengths]
    print("one [rows, L, vocab] float32 logits tensor, MB: " + ", ".join(f"{x:,.0f}" for x in logits_mb))
    if note:
        print(note)
    payload = {"args": vars(args), "machine": info, "parameters": params, "results": results}
    C.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
