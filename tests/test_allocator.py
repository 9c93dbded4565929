"""The glibc malloc settings of graftrl's torch commands (``graftrl.machine.tune_allocator``): set in
the process and handed to its children, never over the user's own, and without changing a sample."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import graftrl.cli.common as cli_common
from graftrl.cli import app
from graftrl.machine import ALLOCATOR_OPT_OUT, ALLOCATOR_SETTINGS

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings"
)

_OURS = {variable: str(value) for _, variable, value in ALLOCATOR_SETTINGS}

# Tunes the allocator, then reports its answer and what a child process inherits.
_PROBE = """
import json, os, subprocess, sys
from graftrl.machine import tune_allocator
tuned = tune_allocator()
child = subprocess.run([sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
                       capture_output=True, text=True, check=True)
print(json.dumps({"tuned": tuned, "child": json.loads(child.stdout)}))
"""


def _probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != ALLOCATOR_OPT_OUT}
    clean.pop("GLIBC_TUNABLES", None)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def _malloc_env(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith("MALLOC_")}


def test_the_settings_apply_here_and_reach_the_processes_it_starts():
    result = _probe()
    assert result["tuned"] is True
    assert _malloc_env(result["child"]) == _OURS


def test_the_users_own_malloc_settings_and_the_opt_out_win():
    mine = _probe(MALLOC_ARENA_MAX="2")
    assert mine["tuned"] is False and _malloc_env(mine["child"]) == {"MALLOC_ARENA_MAX": "2"}
    tunables = _probe(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1")
    assert tunables["tuned"] is False and _malloc_env(tunables["child"]) == {}
    opted_out = _probe(GRAFTRL_MALLOC="default")
    assert opted_out["tuned"] is False and _malloc_env(opted_out["child"]) == {}
    # A process started with graftrl's own settings (a worker) applies them again.
    assert _probe(**_OURS)["tuned"] is True


_SAMPLE = """
import json, sys, torch
from graftrl.machine import tune_allocator
from graftrl.models.policy import Policy
from graftrl.models.rollout import HFRolloutEngine, SamplingParams
tuned = tune_allocator()
torch.set_num_threads(1)
policy = Policy.from_pretrained("p", sys.argv[1], template="{problem}=")
params = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_new_tokens=40)
problems = [f"{a}+{b}" for a in range(8) for b in range(8)]  # 512 rows: tensors of megabytes
rows = []
for seed in (0, 1):
    out = HFRolloutEngine(preallocate_cache=bool(seed)).generate(policy, problems, params, seed=seed)
    rows.append([out.response_ids, [[float(x).hex() for x in lp.tolist()] for lp in out.behaviour_logprobs]])
print(json.dumps({"tuned": tuned, "rows": rows}))
"""


def test_the_samples_are_bit_identical_under_either_setting(tiny_checkpoints: dict[str, Path]):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != ALLOCATOR_OPT_OUT}
    runs = {}
    for setting in ("graftrl", "default"):
        out = subprocess.run(
            [sys.executable, "-c", _SAMPLE, str(tiny_checkpoints["llama"])],
            env={**env, ALLOCATOR_OPT_OUT: setting},
            capture_output=True,
            text=True,
            check=True,
        )
        runs[setting] = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["graftrl"]["tuned"] is True and runs["default"]["tuned"] is False
    assert runs["graftrl"]["rows"] == runs["default"]["rows"]
    assert any(len(ids) > 1 for ids in runs["default"]["rows"][0][0])  # the models did sample


def test_torch_commands_tune_the_allocator_and_others_do_not(tmp_path: Path, monkeypatch):
    calls: list[bool] = []
    monkeypatch.setattr(cli_common, "tune_allocator", lambda: calls.append(True) or True)
    bad = tmp_path / "bad.yaml"
    bad.write_text("nope: 1\n")
    result = CliRunner().invoke(app, ["train", str(bad)])
    assert result.exit_code == 2 and calls == [True]
    CliRunner().invoke(app, ["references"])
    assert calls == [True]
