"""The code verifier's cost: programs verified per second in the bubblewrap sandbox against the
same runs without isolation (``reward.sandbox: none``), and a training step's worth of responses
verified as code against the same number verified as math.

Part 1 (fork server vs sandbox per program vs none): one batch of ``--programs`` distinct programs
(so the verdict cache never answers) of the two test forms, assert statements (a program and a
judge process per program) and stdin/stdout pairs (one process per test), verified with
``--workers`` threads, in the sandbox's fork servers (``reward.code.fork_server``: true, the
default as root), in two new sandboxes per program (``fork_server: false``) and without isolation
(``reward.sandbox: none``). Repeats alternate the three settings (which goes first rotates); the
figure is programs per second, median over repeats, in wall-clock and in the machine's CPU-seconds.

Part 2 (a step's verification, code vs math): ``--prompts`` x ``--n`` responses as one step of
GRAFT verifies them (each policy's own rollouts, one call): code responses drawn from right,
partly right, wrong and crashing programs of the tests' function, and math responses with boxed
answers (a third right), each through its verifier with a warm cache-free verifier per repeat.

Part 3 (a GRAFT step, code vs math): ``--steps`` GRAFT steps of the demo's embedded pair on the
demo's prompts, once with their math answers (``reward.kind: math``) and once with each problem
carrying a test of its answer (``reward.kind: code``, ``assert True`` stand-ins would be cached:
each row's test names its answer). The models write worked arithmetic, not Python, so nearly
every response is a distinct program that fails to compile in the sandbox: the verifier's worst
case per response. Median seconds per step and of its ``time_reward`` phase (verifying and
advantages), the first step left out.

    PYTHONPATH=src .venv/bin/python benchmarks/verifier_speed.py --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=64, help="distinct programs per batch (part 1)")
    ap.add_argument("--tests", type=int, default=4, help="tests per problem")
    ap.add_argument("--workers", type=int, default=2, help="reward.workers: programs run in parallel")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32, help="part 2: prompts of a step")
    ap.add_argument("--n", type=int, default=8, help="part 2: responses per prompt")
    ap.add_argument("--steps", type=int, default=3, help="part 3: GRAFT steps per side (0: skip part 3)")
    ap.add_argument(
        "--cache-dir", default=None, help="part 3: embedded model cache (default ~/.cache/graftrl/embedded)"
    )
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return ap.parse_args(argv)


def cpu_seconds() -> float:
    """CPU-seconds of the whole machine (/proc/stat: user + nice + system, every core): sandboxed
    programs are grandchildren killed with their namespace, which this process's rusage misses, so
    run on an otherwise idle machine."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:4]
    return sum(int(f) for f in fields) / os.sysconf("SC_CLK_TCK")


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def programs(count: int, salt: str) -> list[str]:
    """Distinct correct programs (a comment makes each one its own cache entry)."""
    body = "def f(x):\n    return x * x\n\nif __name__ == '__main__':\n    print(f(int(input())))\n"
    return [f"# {salt} {i}\n{body}" for i in range(count)]


def problems(tests: int):
    from graftrl.storage.data import Problem

    calls = Problem("calls", "x", extra={"tests": [f"assert f({x}) == {x * x}" for x in range(tests)]})
    stdio = Problem(
        "stdio", "x", extra={"tests": [{"input": f"{x}\n", "output": f"{x * x}\n"} for x in range(tests)]}
    )
    return {"asserts": calls, "stdio": stdio}


def timed(verifier, responses, problems_) -> tuple[float, float, list[float]]:
    wall, cpu = time.perf_counter(), cpu_seconds()
    rewards = verifier.rewards(responses, problems_)
    return time.perf_counter() - wall, cpu_seconds() - cpu, rewards


SETTINGS = {
    "fork_server": {"isolation": "bwrap", "fork_server": True},
    "bwrap": {"isolation": "bwrap", "fork_server": False},
    "none": {"isolation": "none"},
}
"""Part 1's settings: the sandbox's fork servers (``reward.code.fork_server``, assert tests only;
stdin/stdout tests run per program in both bwrap settings), two sandboxes per program, none."""


def sandbox_vs_none(args: argparse.Namespace) -> list[dict]:
    from graftrl.verifiers.code import CodeVerifier

    rows = []
    for form, problem in problems(args.tests).items():
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in SETTINGS}
        for repeat in range(args.repeats):
            order = list(SETTINGS)[repeat % 3 :] + list(SETTINGS)[: repeat % 3]  # who goes first rotates
            for name in order:
                verifier = CodeVerifier(workers=args.workers, **SETTINGS[name])
                verifier.start()  # the fork servers of start()'s slot start here, not in the timing
                batch = programs(args.programs, f"{name}-{form}-{repeat}")
                wall, cpu, rewards = timed(verifier, batch, [problem] * len(batch))
                verifier.close()
                assert rewards == [1.0] * len(batch), (name, form, set(rewards))
                runs[name].append((wall, cpu))
        med = {
            k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
            for k, v in runs.items()
        }
        rows.append(
            {
                "form": form,
                "fork-server programs/s": args.programs / med["fork_server"][0],
                "sandboxed programs/s": args.programs / med["bwrap"][0],
                "unsandboxed programs/s": args.programs / med["none"][0],
                "wall ratio (per-program sandbox / fork server)": med["bwrap"][0] / med["fork_server"][0],
                "machine CPU-s per program, fork server": med["fork_server"][1] / args.programs,
                "machine CPU-s per program, sandbox": med["bwrap"][1] / args.programs,
                "machine CPU-s per program, none": med["none"][1] / args.programs,
            }
        )
    return rows


def batch_code_vs_math(args: argparse.Namespace) -> list[dict]:
    from graftrl.config.rewards import RewardConfig
    from graftrl.storage.data import Problem
    from graftrl.verifiers.registry import build_verifier

    rng = random.Random(0)
    variants = [
        "def f(x):\n    return x * x",
        "def f(x):\n    return x * x if x < 2 else x",
        "def f(x):\n    return x + x",
        "def f(x):\n    raise ValueError(x)",
    ]
    tests = [f"assert f({x}) == {x * x}" for x in range(args.tests)]
    code_rows, math_rows = [], []
    for p in range(args.prompts):
        code_problem = Problem(f"c{p}", "x", extra={"tests": tests})
        math_problem = Problem(f"m{p}", "x", answer=str(p * 7))
        for i in range(args.n):
            # distinct per prompt and sample as sampled text is, so the cache answers only repeats
            code_rows.append((f"```python\n# {p} {i % 3}\n{rng.choice(variants)}\n```", code_problem))
            math_rows.append((f"so \\boxed{{{p * 7 + rng.choice((0, 0, 1, 2))}}}", math_problem))
    results = []
    for kind, rows, config in (
        ("code", code_rows, RewardConfig(kind="code", workers=args.workers)),
        ("math", math_rows, RewardConfig(kind="math", workers=1)),
    ):
        walls, cpus = [], []
        for _ in range(args.repeats):
            verifier = build_verifier(config)
            verifier.start()
            wall, cpu, _ = timed(verifier, [r for r, _ in rows], [q for _, q in rows])
            verifier.close()
            walls.append(wall)
            cpus.append(cpu)
        results.append(
            {
                "verifier": kind,
                "responses": len(rows),
                "wall s (median)": statistics.median(walls),
                "machine CPU-s (median)": statistics.median(cpus),
            }
        )
    results.append(
        {
            "verifier": "code / math",
            "responses": len(code_rows),
            "wall s (median)": ratio(results[0]["wall s (median)"], results[1]["wall s (median)"]),
            "machine CPU-s (median)": ratio(
                results[0]["machine CPU-s (median)"], results[1]["machine CPU-s (median)"]
            ),
        }
    )
    return results


def step_code_vs_math(args: argparse.Namespace) -> list[dict]:
    import tempfile

    from graftrl.config import config_from_dict
    from graftrl.embedded.task import DEFAULT_TASK, make_split
    from graftrl.experiments.compare.task import demo_config, demo_settings, write_problems
    from graftrl.training.trainer import Trainer

    settings = demo_settings(DEFAULT_TASK)
    paths = C.embedded_paths(args.cache_dir, DEFAULT_TASK)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        train, _ = make_split(seed=0, n_train=settings.n_train, n_eval=settings.n_eval, task=DEFAULT_TASK)
        math_file = Path(scratch) / "math.jsonl"
        write_problems(train, math_file)
        code_file = Path(scratch) / "code.jsonl"
        code_file.write_text(
            "".join(
                json.dumps({**row, "tests": [f"assert answer() == {row['answer']}"]}) + "\n"
                for row in map(json.loads, math_file.read_text().splitlines())
            )
        )
        for kind, data in (("math", math_file), ("code", code_file)):
            raw = demo_config(paths, data, "graft", 0, settings)
            raw["train"]["steps"] = args.steps
            raw["logging"]["progress"] = False
            raw["reward"] = {"kind": kind, "workers": args.workers}
            out = Path(scratch) / f"run-{kind}"
            trainer = Trainer(config_from_dict(raw), out)
            try:
                trainer.train()
            finally:
                trainer.close()
            logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            later = [r for r in logged if r["step"] > 0] or logged
            rows.append(
                {
                    "reward.kind": kind,
                    "step s (median)": statistics.median(r["time_step"] for r in later),
                    "time_reward s (median, per policy)": statistics.median(r["time_reward"] for r in later),
                    "failures/syntax_error per policy-step": statistics.fmean(
                        r.get("failures/syntax_error", 0) for r in later
                    ),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    C.set_threads(1)
    note = C.contention_note(1)
    if note:
        print(note)
    part1 = sandbox_vs_none(args)
    print(
        C.table(
            list(part1[0]), [list(r.values()) for r in part1], "Programs verified: fork server, sandbox, none"
        )
    )
    part2 = batch_code_vs_math(args)
    title = "One step's responses: code vs math verifier"
    print(C.table(list(part2[0]), [list(r.values()) for r in part2], title))
    part3 = step_code_vs_math(args) if args.steps else []
    if part3:
        title = "GRAFT steps of the embedded pair: code vs math"
        print(C.table(list(part3[0]), [list(r.values()) for r in part3], title))
    if args.json:
        payload = {"sandbox_vs_none": part1, "batch_code_vs_math": part2, "step_code_vs_math": part3}
        C.write_json(args.json, {**payload, "args": vars(args), "machine": C.machine_info()})


if __name__ == "__main__":
    main()
