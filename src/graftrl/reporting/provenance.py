"""Where a reported number came from: the code's commit and the exact weights it started from.

Every results.json of `graftrl compare`, `graftrl sweep` and `graftrl demo` carries
``provenance``: the command that wrote it, the git commit of the graftrl source that ran (and
whether that source had uncommitted changes), the package version, the torch version, the CPU
kernel family torch dispatched to and the CPU's vendor (``graftrl.machine``), and per policy the SHA-256 of its starting weights plus, for an
embedded warm-start, the fingerprint of the settings that made it. A documented figure can then be
checked against the current code: the same fingerprint must warm-start to the same weights on the
same CPU kernels (``tests`` do that for the fingerprints in ``docs/``). Across kernel families
(AVX2, AVX512) and CPU vendors float sums differ in their last bits, so a warm-start's weights do too.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import graftrl
from graftrl.embedded.shipped import REPORT_NAME
from graftrl.files import sha256_bytes, sha256_file
from graftrl.machine import cpu_capability, cpu_vendor

SOURCE_ROOT = Path(graftrl.__file__).resolve().parents[2]
"""The checkout graftrl runs from (``src/graftrl`` two levels up), when it is one."""


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(SOURCE_ROOT), *args], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_commit() -> dict[str, Any]:
    """{"commit", "dirty"}: HEAD of the checkout graftrl runs from and whether its ``src/`` differs
    from it; both None for an installed wheel (no checkout)."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _git("status", "--porcelain", "--", "src")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def command_line(argv: Sequence[str] | None = None) -> str:
    """The running command as a user would type it: ``graftrl <arguments>`` under the ``graftrl``
    entry point, else the process's own argv."""
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).name == "graftrl":
        return shlex.join(["graftrl", *argv[1:]])
    return shlex.join(argv)


def code_label(provenance: Mapping[str, Any]) -> str:
    """The code that ran, in words: ``commit 5418d38d7d`` (``+ uncommitted changes`` when dirty)."""
    commit = provenance.get("commit")
    code = "graftrl (no git checkout)" if commit is None else f"commit {commit[:10]}"
    return code + (" + uncommitted changes" if provenance.get("dirty") else "")


def signature(provenance: Mapping[str, Any]) -> str:
    """One line naming what produced a figure: the command and the code's commit."""
    return f"{provenance.get('command') or 'graftrl'} · {code_label(provenance)}"


def written_by(provenance: Mapping[str, Any]) -> str:
    """The same for a Markdown report: the command in code type, then the commit."""
    return f"Written by `{provenance.get('command') or 'graftrl'}` at {code_label(provenance)}"


def weights_sha256(folder: str | Path) -> str:
    """SHA-256 of a checkpoint's weights: of its one ``*.safetensors`` (else ``*.bin``) file, or
    for several shards, of their names and digests in name order."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors or *.bin weight files")
    digests = [sha256_file(f)[0] for f in files]
    if len(files) == 1:
        return digests[0]
    return sha256_bytes("".join(f"{f.name}:{d}\n" for f, d in zip(files, digests, strict=True)).encode())


def model_provenance(folder: str | Path) -> dict[str, Any]:
    """{"weights_sha256", "warm_start_fingerprint"} of one starting checkpoint (the fingerprint is
    None for a model that is not an embedded warm-start), and ``warm_started_on`` (the CPU kernels)
    for a shipped or pinned copy (``embedded.shipped``), which may have been made on another machine
    than the one recording this."""
    from graftrl.embedded.shipped import shipped_kernels, shipped_models

    folder = Path(folder)
    if folder.name in shipped_models(folder.parent):
        return {**_model_provenance(folder), "warm_started_on": shipped_kernels(folder.parent)}
    return _model_provenance(folder)


def _model_provenance(folder: Path) -> dict[str, Any]:
    fingerprint = None
    report = folder / REPORT_NAME
    if report.is_file():
        try:
            fingerprint = json.loads(report.read_bytes().decode("utf-8")).get("fingerprint")
        except (OSError, ValueError, AttributeError):
            fingerprint = None
    return {"weights_sha256": weights_sha256(folder), "warm_start_fingerprint": fingerprint}


def results_provenance(policies: Mapping[str, str | Path]) -> dict[str, Any]:
    """The ``provenance`` block of a results.json: command, code commit, versions, CPU kernels,
    each policy's start."""
    import torch

    return {
        "command": command_line(),
        **code_commit(),
        "graftrl_version": graftrl.__version__,
        "torch_version": torch.__version__,
        "cpu_capability": cpu_capability(),
        "cpu_vendor": cpu_vendor(),
        "models": {name: model_provenance(path) for name, path in policies.items()},
    }
