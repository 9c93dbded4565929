"""Check that a refactor changed no result: weights, logs and reports of two versions of graftrl.

    python scripts/check_refactor_identity.py --ref 1a5a6dc            # REF against the working tree
    python scripts/check_refactor_identity.py --ref 1a5a6dc --skip-reports

Both versions run from copies of their ``src/`` outside git (``WORK/<label>/src``), so a report's
provenance line reads the same for both, and every command runs with the same arguments (the same
output paths, a launcher named ``graftrl``), so the reports may be compared byte for byte.

Recorded per version (``record``, run with ``PYTHONPATH`` on that version's source, one torch
thread):

- trainings of a representative set of method variants on two tiny random checkpoints (a char
  Llama and a BPE GPT-2) with a verifier that hashes the response text (about a quarter correct,
  so groups mix and all-fail groups get transferred): SHA-256 of each policy's final weights and
  optimizer state, and metrics.jsonl (timing and memory keys left out), compatibility.jsonl and
  samples.jsonl;
- the reports: ``graftrl compare --report-only`` over the committed cells of
  ``experiments/worked`` (table1, table2, the demo preset on the sweep's overlap-0 point; run
  in-process on a task rebuilt from each results.json, so no model is warm-started) and
  ``graftrl analyze`` of committed runs: every file they write (report.md, results.json without
  its wall-clock, results.csv, analysis.md, the figures).

The comparison passes when weights are identical and every logged value the reference logged is
identical; keys only the new version logs are listed (an intended addition), as are report lines
that differ (the line ``Total wall-clock of this invocation`` is a measurement, left out).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_DATA = ROOT / "tests" / "fixtures" / "math_small.jsonl"
EXPERIMENTS = ROOT / "experiments" / "worked"
MEASURED = ("time_", "memory_")
"""Metric keys that are measurements of this machine, not results."""
WALL_CLOCK_LINE = "Total wall-clock of this invocation"

# ----- what is trained ------------------------------------------------------------------------

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "grpo": ("grpo", {}),
    "grpo-dynamic": ("grpo", {"rollout": {"dynamic_sampling": True, "max_sampling_rounds": 2}}),
    "graft": ("graft", {}),
    "graft-no-gate": ("graft", {"graft": {"gate": False}}),
    "graft-random-admission": ("graft", {"graft": {"admission": "random"}}),
    "graft-success-only": ("graft", {"graft": {"transfer": "success_only"}}),
    "graft-pooled": ("graft", {"graft": {"groups": "pooled"}}),
    "graft-peer-first": ("graft", {"graft": {"peer_position": "first"}}),
    "graft-sequence-ratio": ("graft", {"graft": {"ratio_level": "sequence"}}),
    "graft-byte-random-prompts": (
        "graft",
        {"graft": {"compat_normalization": "byte", "selection": "random_prompts", "delta": 0.5}},
    ),
    "graft-kl-tis-transfers": (
        "graft",
        {"train": {"kl_coef": 0.01}, "rollout": {"tis_cap": 2.0}, "logging": {"log_transfers": True}},
    ),
    "sgt": ("sgt", {}),
    "sgt-balanced-last": ("sgt", {"sgt": {"selection": "balanced", "peer_position": "last"}}),
    "hacpo": ("hacpo", {"train": {"kl_coef": 1e-3}}),
    "hacpo-token-prompts": (
        "hacpo",
        {"train": {"kl_coef": 1e-3}, "hacpo": {"loss_agg": "token-mean", "minibatch": "prompts"}},
    ),
    "luffy": ("luffy", {"train": {"kl_coef": 0.01}}),
    "pooling": ("pooling", {}),
}
"""Variant -> (method, config sections merged into the base config)."""


class TextRewards:
    """A pure function of the response text, about 1 in 5 correct (the tests' verifier has 1 in 4):
    about 40% of the groups of n = 4 fail entirely, and most of the peer's groups there are mixed."""

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        return [float(zlib.crc32(r.encode()) % 5 == 0) for r in responses]

    def close(self) -> None:
        pass


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def base_config(paths: dict[str, Path], method: str, steps: int = 3) -> dict[str, Any]:
    """Two tiny policies, n = 4, 8 prompts per step in minibatches of 2 prompts and micro-batches
    of 5 rows (so a minibatch's loss is summed over micro-batches)."""
    return {
        "method": method,
        "seed": 5,
        "policies": [
            {"name": "llama", "path": str(paths["llama"]), "template": "{problem}="},
            {"name": "gpt2", "path": str(paths["gpt2"]), "template": "Q: {problem}\nA: "},
        ],
        "data": {"train": str(FIXTURE_DATA), "prompt_suffix": None},
        "rollout": {"n": 4, "max_new_tokens": 10},
        "train": {"steps": steps, "batch_prompts": 8, "minibatch_prompts": 2, "micro_batch_size": 5},
        "optim": {"lr": 1e-2},
        "logging": {"progress": False},
    }


def build_checkpoints(root: Path) -> dict[str, Path]:
    """A char-level Llama and a BPE GPT-2 (random init, hidden 32), as the tests build them."""
    from graftrl.embedded.models import build_bpe_tokenizer, build_char_tokenizer, build_model
    from graftrl.storage.data import load_problems

    corpus = [p.problem + " " + p.answer for p in load_problems(FIXTURE_DATA)]
    corpus += [f"\\boxed{{{i}}}" for i in range(200)]
    specs = {
        "llama": ("llama", build_char_tokenizer()),
        "gpt2": ("gpt2", build_bpe_tokenizer(corpus, vocab_size=300)),
    }
    paths = {}
    for name, (arch, tokenizer) in specs.items():
        model = build_model(arch, tokenizer, hidden=32, layers=2, heads=2, max_positions=512, seed=1)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = root / name
    return paths


def tensor_digest(named: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    for key in sorted(named):
        value = named[key].detach().cpu().contiguous()
        digest.update(key.encode() + str(value.dtype).encode() + str(tuple(value.shape)).encode())
        digest.update(value.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return digest.hexdigest()


def run_outcome(trainer: Any, run_dir: Path) -> dict[str, Any]:
    """Final weights' and optimizer state's digests per policy, and the logs."""
    from graftrl.storage.rundir import read_jsonl

    out: dict[str, Any] = {"weights": {}, "optimizer": {}}
    for policy in trainer.policies:
        out["weights"][policy.name] = tensor_digest(dict(policy.model.state_dict()))
        state = policy.optimizer.state_dict()["state"]
        out["optimizer"][policy.name] = tensor_digest(
            {f"{index}.{key}": value for index, entry in state.items() for key, value in entry.items()}
        )
    for log in ("metrics", "compatibility", "samples"):
        path = run_dir / f"{log}.jsonl"
        rows = read_jsonl(path) if path.exists() else []
        out[log] = [{k: v for k, v in row.items() if not k.startswith(MEASURED)} for row in rows]
    return out


def train_variants(out: Path, only: Sequence[str]) -> None:
    import torch

    from graftrl.config import config_from_dict
    from graftrl.training.trainer import Trainer

    torch.set_num_threads(1)
    work = out / "runs"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    paths = build_checkpoints(work / "checkpoints")
    results: dict[str, Any] = {}

    def train(name: str, raw: dict[str, Any], resume: bool = False, run_dir: Path | None = None) -> Any:
        run_dir = run_dir or work / name
        trainer = Trainer(config_from_dict(raw), run_dir, verifier=TextRewards())
        trainer.train(resume=resume)
        return trainer, run_dir

    for name, (method, extra) in VARIANTS.items():
        if only and name not in only:
            continue
        print(f"  {name}", flush=True)
        trainer, run_dir = train(name, merge(base_config(paths, method), extra))
        results[name] = run_outcome(trainer, run_dir)
    if not only or "stored-peer" in only:
        print("  stored-peer", flush=True)
        gpt2_only = {**base_config(paths, "grpo"), "store": {"record": True}}
        gpt2_only["policies"] = [p for p in gpt2_only["policies"] if p["name"] == "gpt2"]
        recorder, recorded = train("stored-peer-recording", gpt2_only)
        results["stored-peer-recording"] = run_outcome(recorder, recorded)
        receiver = base_config(paths, "graft")
        receiver["policies"] = [p for p in receiver["policies"] if p["name"] == "llama"]
        receiver["peers"] = [{"name": "gpt2", "path": str(recorded / "store")}]
        trainer, run_dir = train("stored-peer", receiver)
        results["stored-peer"] = run_outcome(trainer, run_dir)
    if not only or "resume" in only:
        print("  resume", flush=True)
        config = merge(base_config(paths, "graft"), {"checkpoint": {"every": 1, "keep_last": 5}})
        train("resume", merge(config, {"train": {"steps": 2}}))
        trainer, run_dir = train("resume", config, resume=True)
        results["resume"] = run_outcome(trainer, run_dir)
    (out / "trainings.json").write_text(json.dumps(results, indent=1, sort_keys=True))


# ----- reports --------------------------------------------------------------------------------

COMPARES: dict[str, tuple[str, int, Path, list[Path]]] = {
    "table2": ("table2", 3, EXPERIMENTS / "table2", [EXPERIMENTS]),
    "table1": ("table1", 5, EXPERIMENTS / "table1", [EXPERIMENTS]),
    "demo": ("demo", 5, EXPERIMENTS / "sweep" / "overlap-0", [EXPERIMENTS / "sweep"]),
}
"""Report -> (preset, seeds, the committed compare it rewrites, --reuse folders)."""
ANALYZED = [
    EXPERIMENTS / "table2" / "runs" / name
    for name in (
        "graft-seed0",
        "no-gate-seed0",
        "random-admission-seed0",
        "pooled-seed1",
        "success-only-seed2",
    )
] + [EXPERIMENTS / "table1" / "runs" / name for name in ("hacpo-seed0", "sgt-seed0")]
"""Committed runs that ``graftrl analyze`` reads."""


def _module_with(names: Sequence[str], attribute: str) -> str:
    """The first of the modules that has ``attribute`` (a name may have moved)."""
    for name in names:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        if hasattr(module, attribute):
            return name
    raise ImportError(f"{attribute} is in none of {names}")


def _import_first(names: Sequence[str], attribute: str) -> Any:
    """``attribute`` from the first of the modules that has it (a name may have moved)."""
    return getattr(importlib.import_module(_module_with(names, attribute)), attribute)


def compare_report(name: str, target: Path) -> None:
    """``graftrl compare --report-only`` of a committed compare, without its models: the task is
    rebuilt from the compare's results.json (each model's weights hash, which is what a cell's
    digest holds of it) and its data files, and the committed warm-start cell is copied in
    (``--reuse`` copies training cells; the warm-start's evaluation would run again). Versions that
    build the embedded task as a base config (``embedded_base_task``) get its config.yaml written
    as ``graftrl.embedded`` writes it, with the recorded provenance standing in for the weights'."""
    import io

    from rich.console import Console

    from graftrl.storage.data import load_problems

    # the compare's modules, where they live now, before the `compare` sub-package and before
    # `graftrl.experiments`
    modules = (
        "graftrl.embedded.base",
        "graftrl.experiments.compare.task",
        "graftrl.experiments.compare_task",
        "graftrl.reporting.compare_task",
        "graftrl.experiments.compare.command",
        "graftrl.experiments.compare",
        "graftrl.reporting.compare",
    )
    run_compare = _import_first(modules[4:], "run_compare")
    demo_config, settings_class = (_import_first(modules, n) for n in ("demo_config", "DemoSettings"))
    preset, seeds, committed, reuse = COMPARES[name]
    results = json.loads((committed / "results.json").read_text())
    shutil.copytree(committed / "data", target / "data")
    shutil.copytree(committed / "runs" / "warm-start", target / "runs" / "warm-start")
    settings = settings_class(**results["settings"])
    models = results["provenance"]["models"]
    paths = {m: Path("/no-weights") / m for m in models}
    base = demo_config(paths, target / "data" / "train.jsonl", "grpo", 0, settings)
    provenance = {**results["provenance"], "command": f"graftrl compare --preset {preset} (identity check)"}
    provenance.update(commit=None, dirty=None)
    try:
        from graftrl.embedded.base import EmbeddedBase

        compare_task = importlib.import_module(_module_with(modules[1:4], "embedded_base_task"))
    except ImportError:  # before the embedded task was a base config
        compare_task = None
    if compare_task is not None and hasattr(compare_task, "embedded_base_task"):
        import yaml

        config = target / "data" / "config.yaml"
        config.write_text(yaml.safe_dump(base, sort_keys=False))
        embedded = EmbeddedBase(
            config, target / "data" / "train.jsonl", target / "data" / "heldout.jsonl", paths, settings,
            results["task"],
        )  # fmt: skip
        compare_task.results_provenance = lambda policies: provenance
        task = compare_task.embedded_base_task(embedded)
    else:
        compare_task_class = _import_first(modules[1:4], "CompareTask")
        heldout = load_problems(target / "data" / "heldout.jsonl")
        task = compare_task_class(results["task"], base, heldout, settings, provenance)
    run_compare(
        target,
        preset,
        seeds=seeds,
        task=task,
        reuse=reuse,
        report_only=True,
        console=Console(file=io.StringIO()),
    )


def write_reports(out: Path, scratch: Path, only: Sequence[str]) -> None:
    """Every report into ``scratch`` (the same path for both versions), then moved under ``out``."""
    launcher = scratch / "bin" / "graftrl"
    launcher.parent.mkdir(parents=True, exist_ok=True)
    launcher.write_text(f"#!{sys.executable}\nfrom graftrl.cli import main\nmain()\n")
    launcher.chmod(0o755)
    env = {**os.environ, "GRAFTRL_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    reports = out / "reports"
    shutil.rmtree(reports, ignore_errors=True)
    names = [*COMPARES, *(f"analyze-{run.parent.parent.name}-{run.name}" for run in ANALYZED)]
    for name in names:
        if only and name not in only:
            continue
        target = scratch / name
        shutil.rmtree(target, ignore_errors=True)
        print(f"  {name}", flush=True)
        if name in COMPARES:
            compare_report(name, target)
        else:
            run = ANALYZED[names.index(name) - len(COMPARES)]
            args = ["analyze", str(run), "--out", str(target)]
            done = subprocess.run(
                [str(launcher), "--threads", "1", *args], cwd=ROOT, env=env, capture_output=True, text=True
            )
            if done.returncode:
                raise SystemExit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        for extra in (target / "runs", target / "data"):  # copies of the committed cells and data
            shutil.rmtree(extra, ignore_errors=True)
        shutil.move(str(target), reports / name)


def record(out: Path, reports: bool, trainings: bool, only: Sequence[str], scratch: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if trainings:
        train_variants(out, only)
    if reports:
        write_reports(out, scratch, only)


# ----- comparing two records ------------------------------------------------------------------


def compare_rows(name: str, old: list[dict], new: list[dict], added: dict[str, set[str]]) -> list[str]:
    problems = []
    if len(old) != len(new):
        return [f"{name}: {len(old)} rows before, {len(new)} after"]
    for index, (a, b) in enumerate(zip(old, new, strict=True)):
        for key in a:
            if key not in b:
                problems.append(f"{name} row {index}: key {key!r} no longer logged")
            elif a[key] != b[key]:
                problems.append(f"{name} row {index}: {key} {a[key]!r} -> {b[key]!r}")
        for key in set(b) - set(a):
            added.setdefault(name.split(" ")[-1], set()).add(key)
    return problems


def compare_trainings(old_path: Path, new_path: Path) -> tuple[list[str], dict[str, set[str]], int]:
    old, new = json.loads(old_path.read_text()), json.loads(new_path.read_text())
    problems, added = [], {}
    for variant, before in old.items():
        after = new.get(variant)
        if after is None:
            problems.append(f"{variant}: not recorded by the new version")
            continue
        for part in ("weights", "optimizer"):
            if before[part] != after[part]:
                problems.append(f"{variant}: {part} differ: {before[part]} -> {after[part]}")
        for log in ("metrics", "compatibility", "samples"):
            problems += compare_rows(f"{variant} {log}", before[log], after[log], added)
    return problems, added, len(old)


def _masked(text: str) -> list[str]:
    return [line for line in text.splitlines() if WALL_CLOCK_LINE not in line]


def compare_reports(old: Path, new: Path) -> tuple[list[str], int]:
    """Differences of every file the reports wrote (results.json without wall-clocks)."""
    problems, files = [], 0
    names = sorted(
        {p.relative_to(old) for p in old.rglob("*") if p.is_file()}
        | {p.relative_to(new) for p in new.rglob("*") if p.is_file()}
    )
    for name in names:
        a, b = old / name, new / name
        files += 1
        if not a.exists() or not b.exists():
            problems.append(f"{name}: only {'after' if b.exists() else 'before'}")
            continue
        if name.suffix == ".json":
            ja, jb = (json.loads(p.read_text()) for p in (a, b))
            for data in (ja, jb):
                if isinstance(data, dict):
                    data.pop("total_wall_s", None)
            if ja != jb:
                problems.append(f"{name}: JSON differs")
        elif name.suffix in (".md", ".csv"):
            la, lb = _masked(a.read_text()), _masked(b.read_text())
            if la != lb:
                diff = difflib.unified_diff(la, lb, "before", "after", lineterm="", n=0)
                problems.append(f"{name}:\n" + "\n".join(list(diff)[:60]))
        elif a.read_bytes() != b.read_bytes():
            problems.append(f"{name}: bytes differ")
    return problems, files


# ----- versions -------------------------------------------------------------------------------


def export_ref(ref: str, target: Path) -> None:
    """REF's tree (git archive), or the working tree for ``WORKTREE``, at ``target`` (src only)."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    if ref == "WORKTREE":
        shutil.copytree(ROOT / "src", target / "src", ignore=shutil.ignore_patterns("__pycache__"))
        return
    archive = target / "src.tar"
    with archive.open("wb") as handle:
        subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], stdout=handle, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    archive.unlink()


def record_version(label: str, ref: str, work: Path, args: argparse.Namespace) -> Path:
    """Record the asked parts of version ``ref`` under ``work/label``; a git ref's parts recorded
    earlier (same commit, whole part) are kept unless ``--again``."""
    out = work / label
    stamp = out / "recorded.json"
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", ref], capture_output=True, text=True
    ).stdout.strip()
    done = json.loads(stamp.read_text()) if stamp.exists() else {}
    parts = [part for part in ("trainings", "reports") if getattr(args, part)]
    if ref != "WORKTREE" and not args.again and not args.only:
        parts = [part for part in parts if done.get(part) != commit]
    if not parts:
        print(f"{label}: recorded earlier ({ref})")
        return out
    export_ref(ref, out / "code")
    print(f"{label}: recording {', '.join(parts)} of {ref}", flush=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(out / "code" / "src"),
        "GRAFTRL_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    command = [sys.executable, __file__, "record", "--out", str(out), "--scratch", str(work / "scratch")]
    command += [] if "reports" in parts else ["--no-reports"]
    command += [] if "trainings" in parts else ["--no-trainings"]
    command += [f"--only={name}" for name in args.only]
    subprocess.run(command, check=True, env=env, cwd=ROOT)
    done.update({part: None if args.only else (commit or ref) for part in parts})
    stamp.write_text(json.dumps(done))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", default="check", choices=["check", "record"])
    parser.add_argument("--ref", default="main", help="the version to compare against (a git ref)")
    parser.add_argument("--new", default="WORKTREE", help="the version checked (a git ref, or WORKTREE)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/graftrl-identity"))
    parser.add_argument("--out", type=Path, help="(record) where this version's results go")
    parser.add_argument("--scratch", type=Path, help="(record) the shared folder reports are written in")
    parser.add_argument("--no-reports", dest="reports", action="store_false")
    parser.add_argument("--no-trainings", dest="trainings", action="store_false")
    parser.add_argument("--only", action="append", default=[], help="a variant or report name (repeatable)")
    parser.add_argument("--again", action="store_true", help="re-record the reference too")
    args = parser.parse_args()
    if args.mode == "record":
        record(args.out, args.reports, args.trainings, args.only, args.scratch)
        return
    before = record_version("before", args.ref, args.work, args)
    after = record_version("after", args.new, args.work, args)
    failed = False
    if args.trainings:
        problems, added, count = compare_trainings(before / "trainings.json", after / "trainings.json")
        print(
            f"\ntrainings: {count} variants; weights, optimizer state and logged values "
            + ("DIFFER" if problems else "identical")
        )
        for log, keys in sorted(added.items()):
            print(f"  keys only the new version logs in {log}: {', '.join(sorted(keys))}")
        for problem in problems:
            print("  " + problem)
        failed |= bool(problems)
    if args.reports:
        problems, files = compare_reports(before / "reports", after / "reports")
        print(f"\nreports: {files} files; " + ("differences:" if problems else "identical"))
        for problem in problems:
            print("  " + problem)
        failed |= bool(problems)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
