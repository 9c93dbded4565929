"""The docs' code blocks cannot rot: each ```python / ```bash block is run here or marked a sketch.

The convention (docs/testing.md): the line before a block is ``<!-- snippet: NAME -->`` (a test
below runs it, named ``test_snippet_<NAME>``) or ``<!-- sketch: WHY -->`` (not run, for that
reason). Cheap snippets run as written in the default tier. Command snippets run in a scratch
folder (in the slow tier when they train many cells), where ``my-pair.yaml`` is a tiny two-model config and
``data/eval/MATH500.jsonl`` the fixture problems; any other change to a command is declared in
``SMOKE`` next to the snippet's name. The TRL snippet runs in the trl tier (``.venv-trl``), with
local tiny models for its hub ids.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import FIXTURES, make_config
from typer.testing import CliRunner

from graftrl.cli import app

ROOT = Path(__file__).parents[1]
DOCUMENTS = (
    "README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")),
    "benchmarks/README.md",
    "experiments/README.md",
    "configs/README.md",
)
RUN_LANGUAGES = ("python", "bash")
"""Blocks in these languages must be run or marked a sketch."""
MARKER = re.compile(r"^<!--\s*(snippet|sketch):\s*(.*?)\s*-->$")
FENCE = re.compile(r"^```(\S*)")

SNIPPETS = {
    "core": "default",
    "method-plugin": "default",
    "own-config": "default",
    "demo": "slow",
    "own-train": "default",
    "own-probe": "default",
    "own-compare": "slow",
    "graft-usage": "default",
    "pair-embedded": "slow",
    "pair-probe": "slow",
    "pair-compare": "slow",
    "pair-analyze": "slow",
    "trl": "trl",
    "verifiers": "default",
    "own-verify": "default",
    "code-demo": "slow",
}
"""Every snippet name the docs may use, with the tier of the test that runs it."""

SMOKE = {
    "demo": "scripts/setup.sh is not rerun (the test runs in the venv it made); demo gets --quick "
    "(the same pipeline at smoke-test size) and a scratch --out",
    "own-compare": "--seeds 3 becomes --seeds 1",
    "code-demo": "both commands get --quick (smoke-test sizes and models) and a scratch folder",
    "trl": "the hub ids become local tiny checkpoints; settings get use_cpu=True, max_steps=2, "
    "per_device_train_batch_size=8, max_completion_length=8",
}
"""Each declared change between a snippet as written and as run."""


@dataclass(frozen=True)
class Block:
    document: str
    line: int
    """1-based line of the opening fence."""
    language: str
    marker: tuple[str, str] | None
    """(snippet | sketch, NAME | WHY) from the line before the fence, None when unmarked."""
    text: str

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"


def parse_blocks(document: str, text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, each with the marker on the line before it."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        found = MARKER.match(previous)
        marker = (found.group(1), found.group(2)) if found else None
        language = fence.group(1).lower()
        blocks.append(Block(document, i + 1, language, marker, "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return blocks


def documented_blocks() -> list[Block]:
    return [b for doc in DOCUMENTS for b in parse_blocks(doc, (ROOT / doc).read_text(encoding="utf-8"))]


def problems(blocks: Iterable[Block], known: dict[str, str], tests: Iterable[str]) -> list[str]:
    """What breaks the convention: unmarked or unexplained blocks, unknown, repeated or missing names."""
    found: list[str] = []
    names: dict[str, str] = {}
    for block in blocks:
        if block.marker is None:
            if block.language in RUN_LANGUAGES:
                found.append(
                    f"{block.where}: a ```{block.language} block is neither <!-- snippet: NAME --> nor <!-- sketch: WHY -->"
                )
            continue
        kind, value = block.marker
        if not value:
            found.append(
                f"{block.where}: <!-- {kind}: --> needs a {'name' if kind == 'snippet' else 'reason'}"
            )
        elif kind == "snippet":
            if value not in known:
                found.append(f"{block.where}: snippet {value!r} is not in tests/test_snippets.py's SNIPPETS")
            if value in names:
                found.append(f"{block.where}: snippet {value!r} is also at {names[value]}")
            names[value] = block.where
    found += [f"snippet {name!r} is in SNIPPETS but in no document" for name in known if name not in names]
    test_names = set(tests)
    found += [
        f"snippet {name!r} has no test_snippet_{name.replace('-', '_')}"
        for name in known
        if f"test_snippet_{name.replace('-', '_')}" not in test_names
    ]
    return found


def snippet(name: str) -> Block:
    (block,) = [b for b in documented_blocks() if b.marker == ("snippet", name)]
    return block


def commands(block: Block) -> list[list[str]]:
    """The block's commands as argument lists (comments dropped; a line ending in ``\\`` continues)."""
    text = re.sub(r"\\\n", " ", block.text)
    return [tokens for line in text.splitlines() if (tokens := shlex.split(line, comments=True))]


def graftrl(args: list[str]) -> str:
    """Run ``graftrl ARGS`` (a snippet's ``graftrl`` or ``.venv/bin/graftrl``) in this process."""
    assert Path(args[0]).name == "graftrl", args
    result = CliRunner().invoke(app, args[1:])
    assert result.exit_code == 0, f"{shlex.join(args)}\n{result.output}"
    return result.output


# ----- the convention ---------------------------------------------------------------------------


def test_every_block_is_run_or_marked_a_sketch():
    found = problems(documented_blocks(), SNIPPETS, globals())
    assert not found, "docs' code blocks (docs/testing.md, 'Snippets that cannot rot'):\n" + "\n".join(found)
    assert set(SMOKE) <= set(SNIPPETS)


def test_the_convention_check_fails_on_what_it_should():
    text = (
        "```bash\nrm -rf /\n```\n\n<!-- sketch: -->\n```python\npass\n```\n"
        "<!-- snippet: nowhere -->\n```bash\nls\n```\n<!-- snippet: core -->\n```python\n1\n```\n"
        "```yaml\nkey: 1\n```\n<!-- sketch: needs a GPU -->\n```bash\nnvidia-smi\n```\n"
    )
    found = problems(
        parse_blocks("x.md", text), {"core": "default", "gone": "default"}, ["test_snippet_core"]
    )
    assert found == [
        "x.md:1: a ```bash block is neither <!-- snippet: NAME --> nor <!-- sketch: WHY -->",
        "x.md:6: <!-- sketch: --> needs a reason",
        "x.md:10: snippet 'nowhere' is not in tests/test_snippets.py's SNIPPETS",
        "snippet 'gone' is in SNIPPETS but in no document",
        "snippet 'gone' has no test_snippet_gone",
    ]


# ----- default tier: cheap snippets as written ----------------------------------------------------


def test_snippet_verifiers(capsys):
    exec(compile(snippet("verifiers").text, "docs/verifiers.md[verifiers]", "exec"), {})
    printed = capsys.readouterr().out
    block = next(b for b in documented_blocks() if b.document == "docs/verifiers.md" and b.language == "text")
    assert printed == block.text  # the output the page shows is what the example prints


def test_snippet_core():
    namespace: dict = {}
    exec(compile(snippet("core").text, "README.md[core]", "exec"), namespace)
    assert namespace["a_to_b"].tolist() == [False, True] and namespace["b_to_a"].tolist() == [True, False]
    assert namespace["peer_adv"].shape == (4,) and float(namespace["peer_adv"].sum()) == pytest.approx(
        0, abs=1e-6
    )
    w = namespace["w"]
    assert float(w[0]) == 0.0 and all(0 < float(x) <= 1 for x in w[1:])  # s = exp(-0.3) < 0.8 is gated out
    assert namespace["logp"].grad is not None and bool(namespace["loss"].isfinite())


def test_snippet_method_plugin(tiny_checkpoints, tmp_path):
    """docs/methods.md's method module, in a fresh process: `method: grpo_wide` trains with its loss."""
    config = make_config(tiny_checkpoints, method="grpo_wide", steps=1)
    script = tmp_path / "plugin.py"
    script.write_text(
        snippet("method-plugin").text
        + f"""

# -- the test's check: a run selects it by name and trains with its loss
import json, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from conftest import TextRewards
from graftrl.config import config_from_dict
from graftrl.training.trainer import Trainer

calls = []
wide_loss = WideClipGRPO.loss
WideClipGRPO.loss = lambda self, batch: calls.append(1) or wide_loss(self, batch)
config = config_from_dict({{**json.loads({json.dumps(json.dumps(config))}), "grpo_wide": {{"eps_high": 0.7}}}})
trainer = Trainer(config, {str(tmp_path / "run")!r}, verifier=TextRewards())
assert isinstance(trainer.method, WideClipGRPO) and config.grpo_wide.eps_high == 0.7
trainer.train()
print(len(calls) > 0, config.grpo_wide.eps_low)
"""
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRAFTRL_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split()[-2:] == ["True", "0.1"]


def test_snippet_own_config():
    """The README's example config is a valid run config (the paper's defaults fill the rest)."""
    from graftrl.config import config_from_dict

    config = config_from_dict(yaml.safe_load(snippet("own-config").text))
    assert config.method == "graft" and [p.name for p in config.policies] == ["smollm3", "qwen3"]
    assert config.train.batch_prompts == 128 and config.rollout.n == 8 and config.validation.files


# ----- the commands, in a scratch folder (slow tier where they train many cells) --------------------------------------------


@pytest.fixture
def my_pair(tiny_checkpoints, tmp_path, monkeypatch) -> Path:
    """A scratch folder holding `my-pair.yaml` (the tiny pair, 2 steps, validated every step),
    `data/train.jsonl` (300 sums: the probe's 256 prompts fit) and `data/eval/MATH500.jsonl` (the
    fixture problems), as the README's commands expect."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "eval").mkdir(parents=True)
    shutil.copy(FIXTURES / "math_small.jsonl", tmp_path / "data" / "eval" / "MATH500.jsonl")
    sums = [
        {"id": f"s{i}", "problem": f"{i % 17}+{i % 5}", "answer": str(i % 17 + i % 5)} for i in range(300)
    ]
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in sums))
    config = make_config(tiny_checkpoints)
    config["data"]["train"] = "data/train.jsonl"
    config["validation"] = {"files": {"MATH500": "data/eval/MATH500.jsonl"}, "every": 1, "samples": 2}
    (tmp_path / "my-pair.yaml").write_text(yaml.safe_dump(config))
    return tmp_path


def run_commands(name: str, adapt: Callable[[list[str]], list[str]] = lambda args: args) -> list[str]:
    return [graftrl(adapt(args)) for args in commands(snippet(name))]


def test_snippet_own_verify(tiny_checkpoints, tmp_path, monkeypatch):
    """`my-code.yaml`: the tiny pair on two code problems (one in each test form, each with a
    canonical solution), and three responses to them."""
    monkeypatch.chdir(tmp_path)
    rows = [
        {"id": "add", "problem": "Write add(a, b).", "tests": ["assert add(1, 2) == 3", "assert add(0, 5) == 5"],
         "canonical_solution": "def add(a, b):\n    return a + b"},
        {"id": "double", "problem": "Print twice the number read.", "tests": [{"input": "21\n", "output": "42\n"}],
         "canonical_solution": "print(2 * int(input()))"},
    ]  # fmt: skip
    (tmp_path / "code.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    responses = [
        {"id": "add", "response": "```python\ndef add(a, b):\n    return a + b\n```"},
        {"id": "add", "response": "def add(a, b):\n    return b"},
        {"id": "double", "response": "import os\nprint(os.environ.get('HOME'))"},
    ]
    (tmp_path / "responses.jsonl").write_text("".join(json.dumps(row) + "\n" for row in responses))
    config = make_config(tiny_checkpoints)
    config["data"] = {"train": "code.jsonl"}
    config["reward"] = {"kind": "code"}
    (tmp_path / "my-code.yaml").write_text(yaml.safe_dump(config))
    checked, scored = (" ".join(out.split()) for out in run_commands("own-verify"))
    assert "2 rows, 0 bad, 2 with a canonical_solution" in checked
    assert "3 responses: mean reward 0.500, 1 of 3 successes (reward >= 1)" in scored
    assert "failures by class: tests_failed 2" in scored


@pytest.mark.slow
def test_snippet_demo(tmp_path):
    """The first command at smoke size (SMOKE['demo']); the README's pasted tables have the
    headers the demo prints today."""
    from rich.console import Console

    from graftrl.reporting.render import diagnostics_table, results_table

    (args,) = commands(snippet("demo"))
    assert args[:3] == ["bash", "scripts/setup.sh", "&&"] and (ROOT / "scripts" / "setup.sh").is_file()
    out = tmp_path / "demo"
    graftrl([*args[3:], "--quick", "--out", str(out)])  # the default model cache, as written
    results = json.loads((out / "results.json").read_text())
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    pasted = readme.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    width = max(len(line) for line in pasted)
    console = Console(width=width, record=True)
    for table in (results_table(results["rows"]), diagnostics_table(results["diagnostics"])):
        console.print(table)
    printed = console.export_text().splitlines()
    header = [line.rstrip() for line in printed if not line.startswith("│")]
    assert [line.rstrip() for line in pasted if not line.startswith("│")] == [
        line for line in header if line and not line.strip().startswith("*")
    ]


@pytest.mark.slow
def test_snippet_code_demo(tmp_path, monkeypatch):
    """The code task end to end at smoke size: the demo trains and evaluates with programs run in
    the sandbox, and the pair it writes is code rows (JSONL and verl's Parquet) whose canonical
    solutions pass `graftrl verify`."""
    monkeypatch.chdir(tmp_path)
    demo, embedded = commands(snippet("code-demo"))
    graftrl([*demo, "--quick", "--out", str(tmp_path / "demo")])
    results = json.loads((tmp_path / "demo" / "results.json").read_text())
    assert {row["method"] for row in results["rows"]} >= {"grpo", "graft"}
    output = " ".join(graftrl([*embedded, "--quick"]).split())
    pair = tmp_path / "my-code-pair"
    assert (pair / "train.parquet").is_file() and "verl format:" in output
    assert yaml.safe_load((pair / "config.yaml").read_text())["reward"]["kind"] == "code"
    checked = " ".join(graftrl(["graftrl", "verify", str(pair / "config.yaml"), "--problems"]).split())
    assert " 0 bad" in checked and "canonical solutions scored" in checked


def test_snippet_own_train(my_pair):
    run_commands("own-train")
    run = my_pair / "runs" / "my-run"
    assert (run / "eval-best" / "eval.md").is_file() and "MATH500" in (
        run / "eval-best" / "eval.md"
    ).read_text()
    assert (run / "analysis" / "analysis.md").is_file()


def test_snippet_own_probe(my_pair):
    run_commands("own-probe")
    out = my_pair / "runs" / "probe" / "my-pair"
    assert (out / "probe.md").is_file() and json.loads((out / "probe.json").read_text())


@pytest.mark.slow
def test_snippet_own_compare(my_pair):
    def one_seed(args: list[str]) -> list[str]:  # SMOKE["own-compare"]
        return [
            ("1" if previous == "--seeds" else arg)
            for previous, arg in zip(["", *args[:-1]], args, strict=True)
        ]

    outputs = run_commands("own-compare", one_seed)
    report = my_pair / "runs" / "compare" / "table1" / "report.md"
    assert report.is_file() and "graft" in report.read_text()
    cells = outputs[-1].split()  # --list-cells: table1's six variants at one seed (and the warm-start)
    assert {"grpo-n8-seed0", "grpo-n32-seed0", "sgt-seed0", "hacpo-seed0", "graft-seed0"} <= set(cells)


def test_snippet_graft_usage(my_pair):
    run_commands("graft-usage")
    runs = my_pair / "runs"
    for name, method in (("graft", "graft"), ("grpo", "grpo"), ("graft-d09", "graft")):
        assert yaml.safe_load((runs / name / "config.yaml").read_text())["method"] == method
    assert (
        yaml.safe_load((runs / "graft-d09" / "config.yaml").read_text())["graft"]["transfer"]
        == "success_only"
    )
    assert (runs / "graft" / "analysis" / "analysis.md").is_file()


# ----- slow tier: docs/your-pair.md's walk-through, as written, in one scratch folder -----------------

WALKTHROUGH = ("pair-embedded", "pair-probe", "pair-compare", "pair-analyze")
"""docs/your-pair.md's blocks in page order: each reads what the one before wrote."""


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory) -> tuple[Path, dict[str, list[str]]]:
    """Run the walk-through's blocks in order in a scratch folder (the default model cache, as
    written); returns the folder and each block's outputs."""
    folder = tmp_path_factory.mktemp("walkthrough")
    here = Path.cwd()
    os.chdir(folder)
    try:
        outputs = {name: run_commands(name) for name in WALKTHROUGH}
    finally:
        os.chdir(here)
    return folder, outputs


@pytest.mark.slow
def test_snippet_pair_embedded(walkthrough):
    folder, outputs = walkthrough
    pair = folder / "runs" / "pair"
    assert yaml.safe_load((pair / "config.yaml").read_text())["data"]["train"] == str(pair / "train.jsonl")
    assert len((pair / "heldout.jsonl").read_text().splitlines()) == 256
    assert "next: graftrl compare --base" in outputs["pair-embedded"][0]


@pytest.mark.slow
def test_snippet_pair_probe(walkthrough):
    from graftrl.reporting.probe_stats import recount

    probe = walkthrough[0] / "runs" / "pair-probe"
    written = json.loads((probe / "probe.json").read_text())
    assert written["probe"]["prompts"] == 256 and len(written["pairs"]) == 2
    assert sum(p["moved"]["groups"] for p in written["pairs"]) > 0  # --set method=graft: GRAFT's plan
    assert recount(probe) == written
    assert sorted(p.name for p in probe.glob("s_*.png")) == [
        "s_gpt2-bpe_to_llama-char.png",
        "s_llama-char_to_gpt2-bpe.png",
    ]


@pytest.mark.slow
def test_snippet_pair_compare(walkthrough):
    report = (walkthrough[0] / "runs" / "pair-smoke" / "report.md").read_text()
    assert "paired Δ heldout" in report
    assert {"graft-seed0", "graft-seed1", "grpo-seed0", "grpo-seed1"} <= {
        p.name for p in (walkthrough[0] / "runs" / "pair-smoke" / "runs").iterdir()
    }


@pytest.mark.slow
def test_snippet_pair_analyze(walkthrough):
    analysis = walkthrough[0] / "runs" / "pair-smoke" / "runs" / "graft-seed0" / "analysis" / "analysis.md"
    assert "complementarity" in analysis.read_text().lower()


# ----- trl tier: the README's TRL snippet, in .venv-trl ------------------------------------------


@pytest.mark.trl
def test_snippet_trl(tiny_checkpoints, tmp_path):
    """Both steps of the README's TRL block as a script (SMOKE['trl']): a recorded store, then a
    GRAFT run that reads it."""
    from graftrl.storage.store import TrajectoryStore

    text = snippet("trl").text
    ids = re.search(r'^peer, receiver = "([^"]+)", "([^"]+)"', text, re.M)
    assert ids, "the TRL snippet names its two models on one line"
    text = text.replace(ids.group(1), str(tiny_checkpoints["gpt2"])).replace(
        ids.group(2), str(tiny_checkpoints["llama"])
    )
    smoke = (
        "settings |= dict(use_cpu=True, max_steps=2, per_device_train_batch_size=8, max_completion_length=8)"
    )
    text, count = re.subn(r"^(settings = dict\(.*)$", rf"\1\n{smoke}", text, count=1, flags=re.M)
    assert count == 1, "the TRL snippet sets its trainer settings in one `settings = dict(...)` line"
    script = tmp_path / "trl_snippet.py"
    script.write_text(text)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRAFTRL_THREADS": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    store = TrajectoryStore(tmp_path / "runs" / "peer" / "store")
    assert store.verify().ok and store.sources() == ["peer"] and store.steps() == [0, 1]
    assert (tmp_path / "runs" / "receiver").is_dir()
