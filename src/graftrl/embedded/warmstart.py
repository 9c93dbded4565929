"""Supervised warm-start of the embedded models (so RL starts from a weak-but-capable policy).

Each spec in :data:`~graftrl.embedded.models.MODEL_SPECS` is trained from random init on a
*family mix* (:mod:`graftrl.embedded.mixes`): mostly its own strong families, with a small share of the
peer's, so it ends strong on its own and weak-but-not-zero on the peer's. Training stops when the
sampled accuracy (temperature 1.0, the real 0/1 reward) on the mix reaches a target, or at a time
cap. The result is saved with ``save_pretrained`` so both ``AutoModelForCausalLM`` and
``AutoTokenizer`` load it back by path.

Sequence layout (the RL trainer's layout): ``prompt_ids + response_ids + [eos]`` with
``prompt_ids = tok.encode(template.format(problem=...))`` and ``response_ids =
tok.encode(response)``, encoded separately, no special tokens added; the loss covers the response
tokens and the EOS.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from graftrl.console import warn
from graftrl.embedded.mixes import (
    EMBEDDED_MIXES,
    MASTERY_DEFICIT_SHARE,
    MASTERY_DRILL_SHARE,
    MASTERY_WARMSTART,
    TASK_MIXES,
    TASK_WARMSTART_SETTINGS,
    WARMSTART_SETTINGS,
    mastery_mixes,
    overlap_mixes,
)
from graftrl.embedded.models import MODEL_SPECS, build_spec, count_parameters
from graftrl.embedded.shipped import (
    REBUILD_ENV,
    REPORT_NAME,
    cache_record,
    cached_problem,
    install_shipped,
    rebuild_requested,
    seal_cached,
    shipped_kernels,
    shipped_models,
)
from graftrl.embedded.task import (
    DEFAULT_TASK,
    ORIGINAL_TASK,
    Problem,
    get_task,
    make_problems,
    problem_row,
    supervised_text,
)
from graftrl.embedded.warmstart_workers import warm_start_in_workers
from graftrl.machine import cpu_kernels

__all__ = [
    "EMBEDDED_MIXES",
    "MASTERY_DEFICIT_SHARE",
    "MASTERY_DRILL_SHARE",
    "MASTERY_WARMSTART",
    "REPORT_NAME",
    "TASK_MIXES",
    "TASK_WARMSTART_SETTINGS",
    "WARMSTART_SETTINGS",
    "encode_pair",
    "fingerprint",
    "mastery_mixes",
    "model_keys",
    "overlap_mixes",
    "prepare_embedded_models",
    "sampled_accuracy",
    "warm_start",
]

_CHECK_EVERY_STEPS = 40
"""``warm_start``'s default check interval (in optimizer steps)."""


def _stop_settings(
    target_accuracy: float, max_steps: int, check_every_steps: int = _CHECK_EVERY_STEPS
) -> dict:
    """The stop settings a model's fingerprint holds: a check interval only where it is not the
    default (so the arithmetic pairs' fingerprints are the ones they always had)."""
    out: dict[str, Any] = {"target_accuracy": target_accuracy, "max_steps": max_steps}
    if check_every_steps != _CHECK_EVERY_STEPS:
        out["check_every_steps"] = check_every_steps
    return out


#: Bump when the warm-start procedure changes in a way that invalidates cached models.
_VERSION = 1


def encode_pair(tok: Any, template: str, problem: str, response: str) -> tuple[list[int], int]:
    """Token ids of ``template(problem) + response + EOS`` and the number of prompt tokens."""
    p = tok.encode(template.format(problem=problem), add_special_tokens=False)
    r = tok.encode(response, add_special_tokens=False)
    return p + r + [tok.eos_token_id], len(p)


def fingerprint(
    spec_name: str, families_mix: Mapping[str, float], seed: int, task: str = ORIGINAL_TASK, **settings: Any
) -> str:
    """A hash of everything that determines a warm-started model (spec, mix, task, settings)."""
    embedded = get_task(task)
    payload: dict[str, Any] = {
        "version": _VERSION,
        "spec_name": spec_name,
        "spec": MODEL_SPECS[spec_name],
        "mix": dict(sorted(families_mix.items())),
        "families": {n: embedded.family(n).description for n in sorted(families_mix)},
        "response_format": embedded.respond(Problem("x", "37+5", "42", "x")) if task != "arith" else None,
        "seed": seed,
        "settings": dict(sorted(settings.items())),
    }
    if task == "arith":
        # arith's payload predates task selection; it stays as it was so its cached models and
        # documented fingerprints remain valid (its families and format set it apart).
        from graftrl.embedded.task import RESPONSE_FORMAT

        payload["response_format"] = RESPONSE_FORMAT
    else:
        payload.update(task=task, max_positions=embedded.max_positions)
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def sampled_accuracy(
    model: Any,
    tok: Any,
    template: str,
    problems: Sequence[Problem],
    temperature: float = 1.0,
    max_new_tokens: int = 32,
    task: str = ORIGINAL_TASK,
) -> dict[str, float]:
    """Per-family success rate of one sample per problem, plus ``"all"``.

    Uses the library's own rollout engine and the task's verifier (math_verify, or for a task whose
    answer is a program the code verifier in its sandbox, success = every test passed), so the
    warm-start target is measured exactly as RL will see it.
    """
    from graftrl.models.policy import Policy
    from graftrl.models.rollout import HFRolloutEngine, SamplingParams

    policy = Policy("warm-start", model, tok, template=template, temperature=temperature)
    batch = HFRolloutEngine().generate(
        policy,
        [p.problem for p in problems],
        SamplingParams(n=1, temperature=temperature, max_new_tokens=max_new_tokens),
    )
    rewards = _task_successes(batch.texts, problems, task)
    per: dict[str, list[float]] = {}
    for problem, value in zip(problems, rewards, strict=True):
        per.setdefault(problem.family, []).append(value)
    acc = {f: sum(v) / len(v) for f, v in sorted(per.items())}
    acc["all"] = sum(sum(v) for v in per.values()) / max(1, sum(len(v) for v in per.values()))
    return acc


def _task_successes(texts: Sequence[str], problems: Sequence[Problem], task: str) -> list[float]:
    """1.0 per response that succeeds, by the task's verifier (``EmbeddedTask.run_config``)."""
    embedded = get_task(task)
    if embedded.tests is None:  # math: the warm-starts of the arithmetic tasks, as they always were
        from graftrl.models.rewards import MathVerifier

        with MathVerifier() as verifier:
            return verifier.score(list(texts), [p.answer for p in problems])
    from graftrl.config.rewards import RewardConfig
    from graftrl.core.advantages import is_success
    from graftrl.storage.data_formats import row_to_problem
    from graftrl.verifiers.registry import build_verifier

    reward = RewardConfig(**embedded.run_config["reward"])
    rows = [row_to_problem(Path(task), str(i), i, problem_row(p, task)) for i, p in enumerate(problems)]
    verifier = build_verifier(reward)
    try:
        verifier.start()
        values = verifier.rewards(list(texts), rows)
    finally:
        verifier.close()
    return [float(is_success(value, reward.success_threshold)) for value in values]


def _corpus(template: str, seed: int, task: str = ORIGINAL_TASK) -> list[str]:
    """Prompts and supervised responses of the task: the BPE tokenizer's training text."""
    probs = make_problems(None, 1000, seed=seed + 777, task=task)
    return [template.format(problem=p.problem) for p in probs] + [supervised_text(p, task) for p in probs]


def warm_start(
    spec_name: str,
    families_mix: Mapping[str, float],
    out_dir: str | Path,
    seed: int = 0,
    target_accuracy: float = 0.8,
    max_steps: int = 800,
    max_seconds: float = 900.0,
    threads: int = 1,
    batch_size: int = 128,
    check_every_steps: int = _CHECK_EVERY_STEPS,
    check_problems: int = 128,
    task: str = ORIGINAL_TASK,
    progress: bool = False,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Supervised warm-start of ``spec_name`` on ``families_mix``; save to ``out_dir``.

    Trains on fresh problems drawn from the mix (batch ``batch_size``), AdamW with a short
    warm-up, and every ``check_every_steps`` optimizer steps samples one response per problem at
    temperature 1.0 for ``check_problems`` fresh problems *per family* and scores them with the
    0/1 reward. Stops once the mix-weighted accuracy reaches ``target_accuracy`` or after
    ``max_steps`` (or, as a safety net, ``max_seconds`` CPU-seconds of training steps: CPU time,
    not wall time, so that other processes on the machine do not change the model). Writes the model, the tokenizer and ``REPORT_NAME``.
    ``report``: called after every optimizer step with ``{"step", "max_steps", "accuracy" (the
    last check's mix-weighted sampled accuracy, None before the first), "target"}``.

    Returns:
        The report: spec, mix, seed, fingerprint, seconds, steps, final per-family accuracy,
        mix-weighted accuracy, whether the target was reached, and the check history.
    """
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    spec = MODEL_SPECS[spec_name]
    template: str = spec["template"]
    fp = fingerprint(
        spec_name,
        families_mix,
        seed,
        task,
        **_stop_settings(
            target_accuracy=target_accuracy, max_steps=max_steps, check_every_steps=check_every_steps
        ),
    )
    embedded = get_task(task)
    t0 = time.perf_counter()
    model, tok = build_spec(
        spec_name, _corpus(template, seed, task), seed=seed, max_positions=embedded.max_positions
    )
    lr = float(spec.get("lr", 3e-3))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = 30
    names = [n for n, w in families_mix.items() if w > 0]
    weights = [families_mix[n] for n in names]
    total_w = sum(weights)
    rng = random.Random(f"warmstart:{spec_name}:{seed}")
    check_round = 0
    history: list[dict[str, Any]] = []
    step = 0
    train_s = 0.0
    reached = False
    acc: dict[str, float] = {}
    sampled: float | None = None
    model.train()
    while True:
        ts = time.process_time()
        batch = make_problems(families_mix, batch_size, seed=rng.randrange(2**31), task=task)
        seqs = [encode_pair(tok, template, p.problem, supervised_text(p, task)) for p in batch]
        width = max(len(s) for s, _ in seqs)
        ids = torch.full((len(seqs), width), tok.pad_token_id)
        labels = torch.full((len(seqs), width), -100)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (s, n_prompt) in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, n_prompt : len(s)] = torch.tensor(s[n_prompt:])
            mask[i, : len(s)] = 1
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        train_s += time.process_time() - ts
        out_of_budget = step >= max_steps or train_s >= max_seconds
        checking = step % check_every_steps == 0 or out_of_budget
        if report is not None and not checking:
            report({"step": step, "max_steps": max_steps, "accuracy": sampled, "target": target_accuracy})
        if checking:
            check_round += 1
            probe = []
            for j, n in enumerate(names):
                count = min(check_problems, embedded.family(n).distinct or check_problems)
                probe += make_problems(
                    [n], count, seed=10_000 * (seed + 1) + 100 * check_round + j, task=task
                )
            acc = sampled_accuracy(
                model, tok, template, probe, max_new_tokens=embedded.max_new_tokens, task=task
            )
            model.train()
            mixed = sum(w * acc[n] for n, w in zip(names, weights, strict=True)) / total_w
            history.append(
                {
                    "step": step,
                    "train_s": round(train_s, 2),
                    # CPU time of this process: the idle-machine wall time when others share the cores.
                    "cpu_s": round(time.process_time(), 1),
                    "loss": round(float(loss.detach()), 4),
                    "acc": acc,
                    "mix_acc": round(mixed, 4),
                }
            )
            sampled = mixed
            if report is not None:
                report({"step": step, "max_steps": max_steps, "accuracy": sampled, "target": target_accuracy})
            if progress:
                print(f"{spec_name} {history[-1]}", flush=True)
            if mixed >= target_accuracy:
                reached = True
                break
            if out_of_budget:
                break
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    report = {
        "spec_name": spec_name,
        "spec": spec,
        "task": task,
        "mix": dict(families_mix),
        "seed": seed,
        "fingerprint": fp,
        "target_accuracy": target_accuracy,
        "max_steps": max_steps,
        "max_seconds": max_seconds,
        "threads": threads,
        "reached_target": reached,
        "steps": step,
        "train_seconds": round(train_s, 2),
        "seconds": round(time.perf_counter() - t0, 2),
        "accuracy": acc,
        "mix_accuracy": history[-1]["mix_acc"] if history else 0.0,
        "parameters": count_parameters(model),
        "history": history,
    }
    (out_dir / REPORT_NAME).write_text(json.dumps(report, indent=2))
    return report


def _cache_problem(out_dir: Path, fp: str, shipped: bool) -> str | None:
    """Why the cached model in ``out_dir`` cannot be used as it is (None: it can), checked at every
    use: its report must name fingerprint ``fp`` and every file must match its recorded SHA-256
    (``shipped.cached_problem``; a cache from before the records is checked against the shipped
    manifest when ``shipped`` and the key is shipped for this machine)."""
    rep = out_dir / REPORT_NAME
    if not rep.is_file() or not (out_dir / "config.json").is_file():
        return f"incomplete ({REPORT_NAME if not rep.is_file() else 'config.json'} missing: an interrupted warm-start?)"
    try:
        report = json.loads(rep.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return f"{REPORT_NAME} is unreadable"
    if not isinstance(report, dict) or report.get("fingerprint") != fp:
        return f"{REPORT_NAME} names another fingerprint than the folder's"
    known = shipped_models().get(out_dir.name) if shipped and shipped_kernels() == cpu_kernels() else None
    return cached_problem(out_dir, known)


def model_keys(
    quick: bool = False,
    seed: int = 0,
    task: str = ORIGINAL_TASK,
    mixes: Mapping[str, Mapping[str, float]] | None = None,
    settings: Mapping[str, float] | None = None,
) -> dict[str, str]:
    """Spec name -> ``<spec>-<fingerprint>``, the folder name ``prepare_embedded_models`` gives each
    model for these arguments (the same defaults)."""
    get_task(task)
    settings = {**TASK_WARMSTART_SETTINGS[task]["quick" if quick else "full"], **(settings or {})}
    return {
        name: f"{name}-"
        + fingerprint(
            name,
            dict((mixes or TASK_MIXES[task])[name]),
            seed,
            task,
            **_stop_settings(
                settings["target_accuracy"],
                settings["max_steps"],
                settings.get("check_every_steps", _CHECK_EVERY_STEPS),
            ),
        )
        for name in MODEL_SPECS
    }


def prepare_embedded_models(
    cache_dir: str | Path,
    quick: bool = False,
    seed: int = 0,
    parallel: bool = True,
    task: str = ORIGINAL_TASK,
    progress: bool = False,
    mixes: Mapping[str, Mapping[str, float]] | None = None,
    settings: Mapping[str, float] | None = None,
    on_progress: Callable[[str, dict[str, Any]], None] | None = None,
    shipped: bool = True,
) -> dict[str, Path]:
    """Warm-start both embedded models for ``task`` (or reuse the cache); their folders by spec name.

    ``mixes``: family mix per spec name, default the task's (``TASK_MIXES``; ``overlap_mixes``
    gives the sweep's). ``settings``: stop settings replacing the task's (e.g. ``MASTERY_WARMSTART``).
    ``on_progress(spec name, report)``: each model's ``warm_start`` reports, in this process
    (a display; workers send theirs through a queue).

    A model is reused when ``cache_dir/<spec>-<fingerprint>/`` holds a report with the same
    fingerprint (spec, mix, task, seed, stop settings). A missing model that graftrl ships
    (``embedded.shipped``: the default pair) is installed from the verified artifact unless
    ``shipped`` is False or ``GRAFTRL_REBUILD_EMBEDDED=1``; the others are trained in parallel
    processes (one thread each), which is faster on 2 cores than one after the other.
    """
    cache_dir = Path(cache_dir)
    get_task(task)  # an unknown name fails here, before any training
    settings = {**TASK_WARMSTART_SETTINGS[task]["quick" if quick else "full"], **(settings or {})}
    jobs: dict[str, dict[str, Any]] = {}
    paths: dict[str, Path] = {}
    for name, key in model_keys(quick, seed, task, mixes, settings).items():
        mix = dict((mixes or TASK_MIXES[task])[name])
        fp = key.removeprefix(f"{name}-")
        out = cache_dir / key
        paths[name] = out
        problem = None
        if out.exists():
            problem = _cache_problem(out, fp, shipped)
            if problem is None:
                continue
            # One line, then the entry is made again: never train from weights that changed.
            reinstall = (
                shipped
                and out.name in shipped_models()
                and not rebuild_requested()
                and shipped_kernels() == cpu_kernels()
            )
            warn(
                f"cached model {out}: {problem}; "
                + ("reinstalling it from the shipped warm-start" if reinstall else "warm-starting it again")
            )
            shutil.rmtree(out)
            cache_record(out).unlink(missing_ok=True)
        if shipped and install_shipped(out.name, out):
            seal_cached(out)
            if problem is None:  # (a reinstall was announced in its warning)
                print(
                    f"{name}: the shipped warm-start (SHA-256 verified); {REBUILD_ENV}=1 trains it here instead",
                    file=sys.stderr,
                )
        else:
            jobs[name] = {
                "spec_name": name,
                "families_mix": mix,
                "out_dir": str(out),
                "seed": seed,
                "task": task,
                "progress": progress,
                **settings,
            }
    if jobs:
        if parallel and len(jobs) > 1:
            warm_start_in_workers(warm_start, jobs, on_progress)
        else:
            import torch

            for name, kw in jobs.items():  # in this process, on the threads it was given (--threads)
                report = (lambda info, name=name: on_progress(name, info)) if on_progress else None
                warm_start(threads=torch.get_num_threads(), report=report, **kw)
        for name in jobs:
            seal_cached(paths[name])
            report = json.loads((paths[name] / REPORT_NAME).read_text())
            if not report["reached_target"]:
                print(
                    f"warning: the warm-start of {name} stopped after {report['steps']} steps "
                    f"({report['train_seconds']:.0f} CPU-s) at sampled accuracy {report['mix_accuracy']:.2f}, "
                    f"under its target {report['target_accuracy']}",
                    file=sys.stderr,
                )
    return paths


def _main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Warm-start the embedded models.")
    ap.add_argument("--cache-dir", default="/tmp/graftrl-embedded")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sequential", action="store_true")
    ap.add_argument("--task", default=DEFAULT_TASK)
    ap.add_argument("--rebuild", action="store_true", help="warm-start even a model graftrl ships")
    args = ap.parse_args()
    t = time.perf_counter()
    paths = prepare_embedded_models(
        args.cache_dir,
        args.quick,
        args.seed,
        parallel=not args.sequential,
        task=args.task,
        progress=True,
        shipped=not args.rebuild,
    )
    for name, p in paths.items():
        rep = json.loads((p / REPORT_NAME).read_text())
        print(
            name, p, {k: rep[k] for k in ("steps", "train_seconds", "seconds", "accuracy", "reached_target")}
        )
    print(f"total {time.perf_counter() - t:.1f}s", math.nan if not paths else "")


if __name__ == "__main__":
    _main()
