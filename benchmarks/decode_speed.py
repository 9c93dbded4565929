"""HF sampling on the CUDA tier's ~0.5B Qwen2: eager against compiled decode, TRL beside them, and a
whole GRAFT step of the tier's two heterogeneous ~0.5B models (issue 41).

Samplers, on the same model, prompts (P prompts x n = 8 samples, P = rows / 8) and lengths, bf16
autocast over float32 weights, every one recording what its trainer needs:

- ``hf``: graftrl's HF engine, eager (``rollout.compile: false``: ``generate`` with the behaviour
  log-prob recorder, preallocated KV cache, shared prompt prefill);
- ``hf-compiled``: graftrl's HF engine, compiled (``rollout.compile: true``: static cache, compiled
  decode step replayed as a CUDA graph, ``models.compiled_decode``);
- ``hf-static``: transformers' own compiled decoding, ``generate`` with a static cache and
  ``CompileConfig(mode="reduce-overhead")`` (torch.compile's CUDA graphs), the same recorder;
- ``trl``: TRL's ``GRPOTrainer._generate`` with TRL's own HF options (``generate`` with
  ``disable_compile=True``, its default cache), the prompts repeated n times as its sampler does,
  under bf16 autocast as in its training step; when TRL does not import, ``generate`` with the
  GenerationConfig TRL builds (the figure then says so).

Per (sampler, rows, new tokens) cell: a warm-up call (compiled samplers: a full call, whose compile
time is reported apart; eager ones: 8 tokens), then one timed call: ms per decode step = call time /
tokens per row. A random model rarely samples EOS, so rows run to the limit. The GRAFT step:
graftrl's Trainer (method graft, ``rollout.compile`` as given), the first step (compiles) and the
second (timed) reported apart.

The work is ordered by what the issue needs first (the 64-row x 256-token cell of each sampler, then
the compiled grid, the GRAFT step, the rest); with ``--budget-s`` a measurement that would not end in
time is skipped and listed. The JSON is rewritten after every measurement.

    PYTHONPATH=src python benchmarks/decode_speed.py --models DIR --json decode.json     # CUDA
    PYTHONPATH=src python benchmarks/decode_speed.py --models DIR --tiny                 # CPU, tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tier's model builder
import _common as C

ENGINES = ("hf", "hf-compiled", "hf-static", "trl")
SAMPLES = 8
"""n: rows / 8 prompts per cell (a GRPO group)."""
EAGER_WARMUP_TOKENS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--models", required=True, help="folder of the cuda tier's models (built there if absent)"
    )
    ap.add_argument("--tiny", action="store_true", help="CPU, the tier's tiny models, small cells")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--rows", default=None, help="default 16,64,256 (--tiny: 8,16)")
    ap.add_argument("--new-tokens", default=None, help="default 256,1024 (--tiny: 8,16)")
    ap.add_argument("--graft-new-tokens", type=int, default=None, help="default 512 (--tiny: 8); 0: no step")
    ap.add_argument(
        "--graft-compile", default="auto", choices=["auto", "true"], help="rollout.compile of the GRAFT step"
    )
    ap.add_argument("--graft-eager", action="store_true", help="also a GRAFT step with rollout.compile false")
    ap.add_argument("--budget-s", type=float, default=0, help="skip what would end after this (0: no limit)")
    ap.add_argument("--prompt-words", type=int, default=None, help="default 40 (--tiny: 6)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tiny = args.tiny
    args.rows = [int(x) for x in (args.rows or ("8,16" if tiny else "16,64,256")).split(",")]
    args.new_tokens = [int(x) for x in (args.new_tokens or ("8,16" if tiny else "256,1024")).split(",")]
    args.graft_new_tokens = (
        args.graft_new_tokens if args.graft_new_tokens is not None else (8 if tiny else 512)
    )
    args.prompt_words = args.prompt_words or (6 if tiny else 40)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        ap.error(f"--engines: unknown {sorted(unknown)} (known: {', '.join(ENGINES)})")
    return args


# ----- set-up -------------------------------------------------------------------------------------
def tier_models(folder: Path) -> dict[str, Path]:
    """The cuda tier's pair (``llama`` char tokenizer, ``qwen`` BPE), its size by the tier's rule."""
    from cuda_tier import SIZE, build_pair

    return build_pair(folder, (SIZE.llama, SIZE.qwen), SIZE.name)


def problems(count: int, words: int, seed: int):
    from graftrl.storage.data import MathProblem

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocabulary = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(2000)]
    out = []
    for i in range(count):
        a, b = rng.randint(10, 999), rng.randint(1, 99)
        filler = " ".join(rng.choice(vocabulary) for _ in range(words))
        out.append(MathProblem(f"p{i}", f"{filler} {a}+{b}=", str(a + b)))
    return out


class Clock:
    def __init__(self, cuda: bool) -> None:
        import torch

        self.sync = torch.cuda.synchronize if cuda else (lambda: None)

    def time(self, call: Callable[[], Any]) -> tuple[float, Any]:
        self.sync()
        start = time.perf_counter()
        out = call()
        self.sync()
        return time.perf_counter() - start, out


# ----- samplers: each returns a callable (problems, max_new_tokens) -> (tokens per row, extra) ----
def graftrl_sampler(policy, compile_setting: bool):
    from graftrl.models.rollout import HFRolloutEngine, SamplingParams

    engine = HFRolloutEngine(compile=compile_setting)

    def run(texts, new_tokens: int):
        batch = engine.generate(policy, texts, SamplingParams(n=SAMPLES, max_new_tokens=new_tokens), seed=0)
        extra = {"timings": [dataclasses.asdict(t) for t in engine.timings]}
        return max(len(r) for r in batch.response_ids), extra

    return run


def hf_static_sampler(policy):
    """transformers' compiled decoding: generate + a static cache + CompileConfig (CUDA graphs)."""
    from transformers import GenerationConfig, LogitsProcessorList
    from transformers.generation.configuration_utils import CompileConfig

    from graftrl.models.compiled_decode import cache_length, static_cache
    from graftrl.models.kv_cache import cache_argument
    from graftrl.models.rollout import _BehaviourLogprobRecorder, checkpoint_sampling_defaults_off

    model = policy.model

    def run(texts, new_tokens: int):
        prompt_ids = policy.encode_prompts(texts)
        batch = policy.pad(prompt_ids, [[] for _ in prompt_ids])
        width = batch.prompt_width
        ids = batch.input_ids[:, :width].repeat_interleave(SAMPLES, 0)
        mask = batch.attention_mask[:, :width].repeat_interleave(SAMPLES, 0)
        compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
        compile_config._compile_all_devices = True  # also on CPU (the dry run)
        config = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
            eos_token_id=policy.eos_token_id, pad_token_id=int(policy.tokenizer.pad_token_id),
            compile_config=compile_config,
        )  # fmt: skip
        # graftrl's static layers: under autocast the keys are float32, the values bf16
        cache = static_cache(model, cache_length(width, new_tokens), static_addresses=True)
        recorder = _BehaviourLogprobRecorder(1.0, 1.0)
        with policy.eval_mode(), policy.autocast(), checkpoint_sampling_defaults_off(model):
            out = model.generate(
                input_ids=ids, attention_mask=mask, generation_config=config,
                logits_processor=LogitsProcessorList([recorder]), **{cache_argument(model): cache},
            )  # fmt: skip
        recorder.finish(out[:, -1])
        return out.shape[1] - width, {}

    return run


def trl_sampler(model_path: Path, device: str, tiny: bool):
    """TRL's GRPOTrainer._generate, or (no TRL here) generate with the GenerationConfig TRL builds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16)
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as error:
        return _trl_settings_generate(model, tokenizer, autocast), f"TRL not importable ({error})"
    trainers: dict[int, Any] = {}

    def trainer_for(new_tokens: int):
        if new_tokens not in trainers:  # max_completion_length is fixed at construction
            config = GRPOConfig(
                output_dir=str(Path(os.environ.get("TMPDIR", "/tmp")) / "decode-speed-trl"),
                num_generations=SAMPLES, per_device_train_batch_size=SAMPLES, max_completion_length=new_tokens,
                temperature=1.0, top_p=1.0, use_vllm=False, bf16=not tiny, use_cpu=device == "cpu",
                report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True,
            )  # fmt: skip
            trainers[new_tokens] = GRPOTrainer(
                model=model, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=config,
                train_dataset=Dataset.from_list([{"prompt": "x"}]), processing_class=tokenizer,
            )  # fmt: skip
        return trainers[new_tokens]

    def run(texts, new_tokens: int):
        trainer = trainer_for(new_tokens)
        trainer.model.train()  # as in its training step: mode "train", num_generations samples
        with autocast:
            output = trainer._generate([t for t in texts for _ in range(SAMPLES)])
        completions = output[1] if isinstance(output, tuple) else output["completion_ids"]
        return max(len(c) for c in completions), {}

    return run, None


def _trl_settings_generate(model, tokenizer, autocast):
    import torch
    from transformers import GenerationConfig

    def run(texts, new_tokens: int):
        config = GenerationConfig(
            max_new_tokens=new_tokens, do_sample=True, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, temperature=1.0,
            top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, cache_implementation=None,
            disable_compile=True,
        )  # fmt: skip
        tokenizer.padding_side = "left"
        inputs = tokenizer([t for t in texts for _ in range(SAMPLES)], return_tensors="pt", padding=True)
        with torch.no_grad(), autocast:
            out = model.generate(**inputs.to(model.device), generation_config=config)
        return out.shape[1] - inputs["input_ids"].shape[1], {}

    return run


# ----- the plan -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    """Measurements in order, each skipped when ``--budget-s`` would not cover its estimate."""

    budget_s: float
    start: float = dataclasses.field(default_factory=time.perf_counter)
    skipped: list[str] = dataclasses.field(default_factory=list)

    def left(self) -> float:
        return float("inf") if not self.budget_s else self.budget_s - (time.perf_counter() - self.start)

    def fits(self, name: str, estimate_s: float) -> bool:
        if estimate_s <= self.left():
            return True
        self.skipped.append(f"{name} (estimated {estimate_s:.0f} s, {max(0.0, self.left()):.0f} s left)")
        print(f"skipped {self.skipped[-1]}", flush=True)
        return False


def cell_order(args) -> list[tuple[str, int, int]]:
    """(engine, rows, new tokens): each engine's headline cell (64 x 256, or the nearest) first, then
    the compiled grid, then the other engines' cells."""
    head = (min(args.rows, key=lambda r: abs(r - 64)), min(args.new_tokens, key=lambda t: abs(t - 256)))
    cells = [(e, *head) for e in ("hf-compiled", "hf", "trl") if e in args.engines]
    grid = [(r, t) for t in sorted(args.new_tokens) for r in sorted(args.rows)]
    cells += [("hf-compiled", r, t) for r, t in grid if "hf-compiled" in args.engines]
    cells += [(e, *head) for e in ("hf-static",) if e in args.engines]
    cells += [(e, r, t) for e in ("hf", "trl", "hf-static") if e in args.engines for r, t in grid]
    seen, out = set(), []
    for cell in cells:
        if cell not in seen:
            seen.add(cell)
            out.append(cell)
    return out


def estimate(engine: str, rows: int, tokens: int, measured: dict) -> float:
    """Seconds for a cell's warm-up and timed call, from what was measured (generous when nothing was)."""
    same = [r for (e, _, _), r in measured.items() if e == engine and "ms_per_step" in r]
    per_step = max((r["ms_per_step"] for r in same), default=None)
    if per_step is None:
        return 30.0 if engine != "hf-static" else 90.0  # a first compile
    warmup = tokens if engine in ("hf-compiled", "hf-static") else EAGER_WARMUP_TOKENS
    return (tokens + warmup) * per_step * max(1.0, rows / 64) ** 0.3 / 1000 + 5


def measure_cell(sampler, clock: Clock, engine: str, texts, tokens: int) -> dict[str, Any]:
    compiled = engine in ("hf-compiled", "hf-static")
    warm_s, (_, warm_extra) = clock.time(lambda: sampler(texts, tokens if compiled else EAGER_WARMUP_TOKENS))
    wall_s, (steps, extra) = clock.time(lambda: sampler(texts, tokens))
    result: dict[str, Any] = {"rows": len(texts) * SAMPLES, "new_tokens": tokens, "steps": steps}
    result.update(wall_s=wall_s, ms_per_step=1000 * wall_s / max(1, steps), warmup_s=warm_s)
    if compiled:  # the warm-up call compiled: its excess over a timed call is the compile (and capture)
        result["first_call_s"] = warm_s
        result["compile_s_first_call"] = max(0.0, warm_s - wall_s)
    timings = extra.get("timings")
    if timings:
        result["compile_s_first_call"] = sum(t["compile_s"] for t in warm_extra.get("timings", []))
        result["compile_s_timed_call"] = sum(t["compile_s"] for t in timings)
        decode = sum(t["decode_s"] for t in timings)
        result["decode_ms_per_step"] = 1000 * decode / max(1, max(t["steps"] for t in timings) - 1)
        result.update(
            prefill_s=sum(t["prefill_s"] for t in timings),
            capture_s=sum(t["capture_s"] for t in timings),
            cuda_graph=all(t["graph"] for t in timings),
            padded_rows=timings[0]["padded_rows"],
            cache_length=timings[0]["cache_length"],
        )
    return result


def graft_step(args, paths: dict[str, Path], compile_setting: bool | str, device: str) -> dict[str, Any]:
    """Two steps of graftrl's Trainer, method graft, on the tier's pair: the first (compiles) and the
    second (timed) apart."""
    from graftrl.config import config_from_dict
    from graftrl.storage.rundir import read_metrics
    from graftrl.training.trainer import Trainer

    prompts = 8 if not args.tiny else 2
    raw = {
        "method": "graft",
        "seed": args.seed,
        "policies": [
            {"name": name, "path": str(path), "template": "{problem}", "dtype": "bfloat16", "device": device}
            for name, path in paths.items()
        ],
        "data": {"train": str(Path(args.models) / "unused.jsonl"), "prompt_suffix": None},
        "rollout": {"n": SAMPLES, "max_new_tokens": args.graft_new_tokens, "compile": compile_setting},
        "train": {
            "steps": 2,
            "batch_prompts": prompts,
            "minibatch_prompts": prompts,
            "micro_batch_size": 16,
            "logprob_chunk_tokens": 512,
        },
        "graft": {"balance": False},
        "optim": {"lr": 1e-6},
        "logging": {"progress": False, "log_samples": 0},
        "checkpoint": {"every": 0},
    }
    import tempfile

    marks: list[float] = []
    clock = Clock(device == "cuda")
    with tempfile.TemporaryDirectory(prefix="decode-speed-graft-") as tmp:
        trainer = Trainer(
            config_from_dict(raw),
            Path(tmp) / "run",
            problems=problems(prompts * 3, args.prompt_words, args.seed + 1),
            verifier=C.CoinVerifier(args.seed),
            step_callback=lambda step, metrics: (clock.sync(), marks.append(time.perf_counter())),
        )
        trainer.save_checkpoint = lambda step: None  # 12 GB of weights and AdamW state: not the step
        start = time.perf_counter()
        trainer.train()
        rows = read_metrics(Path(tmp) / "run")
        compile_s = {w.policy.name: getattr(w.engine, "compile_seconds", 0.0) for w in trainer.workers}
    keys = ("time_rollout", "time_update", "time_peer_logprob", "time_step", "response_length")
    per_step = [{k: r.get(k) for k in ("step", "model", *keys)} for r in rows]
    return {
        "compile": compile_setting,
        "prompts": prompts,
        "new_tokens": args.graft_new_tokens,
        "step_wall_s": [b - a for a, b in zip([start, *marks[:-1]], marks, strict=True)],
        "compile_s": compile_s,
        "metrics": per_step,
    }


# ----- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        C.set_threads(args.threads)
    C.quiet_hf()
    import torch

    if args.tiny:
        os.environ.setdefault("GRAFTRL_CUDA_TIER_ON_CPU", "1")
        os.environ.setdefault("GRAFTRL_CUDA_TIER_SIZE", "tiny")
    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    if not args.tiny and not cuda:
        raise SystemExit("no CUDA device here: run with --tiny (CPU, the tier's tiny models)")
    from graftrl.models.policy import Policy

    plan, clock = Plan(args.budget_s), Clock(cuda)
    paths = tier_models(Path(args.models))
    meta = {name: json.loads((path / "bench_model.json").read_text()) for name, path in paths.items()}
    policy = Policy.from_pretrained("qwen", str(paths["qwen"]), dtype="bfloat16", device=device)
    texts_for = {rows: [p.problem for p in problems(max(1, rows // SAMPLES), args.prompt_words, args.seed)]
                 for rows in args.rows}  # fmt: skip
    samplers: dict[str, Any] = {}
    notes: list[str] = []
    measured: dict[tuple[str, int, int], dict[str, Any]] = {}
    payload: dict[str, Any] = {"args": vars(args), "machine": C.machine_info(), "models": meta}

    def save() -> None:
        payload.update(
            cells=[{"engine": e, **r} for (e, _, _), r in measured.items()],
            skipped=plan.skipped,
            notes=notes,
        )
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(payload, indent=2, default=str))

    def sampler(engine: str):
        if engine not in samplers:
            if engine in ("hf", "hf-compiled"):
                samplers[engine] = graftrl_sampler(policy, engine == "hf-compiled")
            elif engine == "hf-static":
                samplers[engine] = hf_static_sampler(policy)
            else:
                samplers[engine], why = trl_sampler(paths["qwen"], device, args.tiny)
                if why:
                    notes.append(f"trl: {why}; measured transformers' generate with TRL's GenerationConfig")
        return samplers[engine]

    def run_cells(cells) -> None:
        for engine, rows, tokens in cells:
            name = f"{engine} {rows} rows x {tokens} tokens"
            if not plan.fits(name, estimate(engine, rows, tokens, measured)):
                continue
            try:
                result = measure_cell(sampler(engine), clock, engine, texts_for[rows], tokens)
            except Exception as error:  # one sampler failing must not lose the others' figures
                result = {"rows": rows, "new_tokens": tokens, "error": f"{type(error).__name__}: {error}"}
            measured[(engine, rows, tokens)] = result
            shown = (
                result.get("error") or f"{result['ms_per_step']:.2f} ms/step, call {result['wall_s']:.1f} s"
            )
            print(f"{name}: {shown}", flush=True)
            save()

    def run_graft(setting: bool | str, estimate_s: float) -> None:
        if not args.graft_new_tokens or not plan.fits(f"GRAFT step (compile {setting})", estimate_s):
            return
        try:
            result = graft_step(args, paths, setting, device)
        except Exception as error:
            result = {"compile": setting, "error": f"{type(error).__name__}: {error}"}
        payload.setdefault("graft_steps", []).append(result)
        save()

    order = cell_order(args)
    heads = order[: len({e for e, _, _ in order} & {"hf-compiled", "hf", "trl"})]
    compiled_grid = [c for c in order if c[0] == "hf-compiled" and c not in heads]
    run_cells([*heads, *compiled_grid])
    run_graft(True if args.graft_compile == "true" else "auto", 60.0)
    run_cells([c for c in order if c not in measured])
    if args.graft_eager:
        run_graft(False, 120.0)
    save()
    report(payload, device)
    return payload


def report(payload: dict[str, Any], device: str) -> None:
    cells = payload["cells"]
    rows = [
        [
            c["engine"], c["rows"], c["new_tokens"], c.get("steps"), c.get("ms_per_step"),
            c.get("decode_ms_per_step"), c.get("compile_s_first_call"), c.get("cuda_graph"),
            c.get("wall_s"), c.get("error", ""),
        ]
        for c in cells
    ]  # fmt: skip
    qwen = payload["models"].get("qwen", {})
    title = (
        f"HF sampling, {qwen.get('parameters', 0) / 1e6:.1f}M-parameter Qwen2, bf16 autocast on {device} "
        f"({payload['machine'].get('cuda') or 'cpu'}); P = rows / 8 prompts x n = 8; ms per step = timed call / "
        "tokens per row (compile apart)"
    )
    headers = [
        "sampler",
        "rows",
        "new tokens",
        "steps",
        "ms/step",
        "decode ms/step",
        "compile s",
        "CUDA graph",
    ]
    print(C.table([*headers, "call s", "error"], rows, title=title))
    by = {(c["engine"], c["rows"], c["new_tokens"]): c for c in cells if "ms_per_step" in c}
    ratios = [
        [rows, tokens, by[("hf", rows, tokens)]["ms_per_step"] / c["ms_per_step"],
         by[("trl", rows, tokens)]["ms_per_step"] / c["ms_per_step"] if ("trl", rows, tokens) in by else None]
        for (engine, rows, tokens), c in by.items()
        if engine == "hf-compiled" and ("hf", rows, tokens) in by
    ]  # fmt: skip
    if ratios:
        print(C.table(["rows", "new tokens", "eager / compiled", "TRL / compiled"], ratios))
    for step in payload.get("graft_steps", []):
        if "error" in step:
            print(f"GRAFT step (compile {step['compile']}): {step['error']}")
            continue
        print(
            f"GRAFT step of the pair (compile {step['compile']}, {step['prompts']} prompts x n = {SAMPLES}, "
            f"{step['new_tokens']} new tokens): wall {', '.join(f'{s:.1f}' for s in step['step_wall_s'])} s "
            f"(step 1 compiles: {step['compile_s']})"
        )
        print(C.table(["step", "model", "rollout s", "update s", "peer log-prob s", "step s", "response length"],
                      [[m["step"], m["model"], m["time_rollout"], m["time_update"], m["time_peer_logprob"],
                        m["time_step"], m["response_length"]] for m in step["metrics"]]))  # fmt: skip
    for line in payload["notes"] + [f"skipped (budget): {s}" for s in payload["skipped"]]:
        print(line)


if __name__ == "__main__":
    main()
