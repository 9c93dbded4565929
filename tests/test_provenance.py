"""Documented results belong to the current code: results record where they came from, and the
warm-start fingerprints documented in docs/ are the ones the code computes (the slow tier also
re-runs those warm-starts and compares the weights byte for byte)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from graftrl.embedded.models import MODEL_SPECS
from graftrl.embedded.warmstart import (
    REPORT_NAME,
    model_keys,
    prepare_embedded_models,
)
from graftrl.machine import cpu_kernels
from graftrl.reporting.provenance import (
    code_commit,
    command_line,
    model_provenance,
    results_provenance,
    signature,
    weights_sha256,
    written_by,
)

DOCS = Path(__file__).parents[1] / "docs"
DOCUMENTED = sorted(DOCS.rglob("provenance.json"))


def documented_fingerprint(doc: dict, name: str) -> str:
    key = model_keys(doc["warm_start"] == "quick", doc["seed"], doc["task"])[name]
    return key.removeprefix(f"{name}-")


def test_there_is_documented_provenance():
    assert DOCUMENTED, "docs/ should document where its demo results came from"


@pytest.mark.parametrize("path", DOCUMENTED, ids=lambda p: str(p.relative_to(DOCS)))
def test_documented_fingerprints_are_what_the_code_computes(path):
    """A change to a task, its mixes or its warm-start settings changes the fingerprint: the
    documented results would then no longer be reproduced by their command."""
    doc = json.loads(path.read_text())
    assert set(doc["models"]) == set(MODEL_SPECS)
    for name, model in doc["models"].items():
        assert model["warm_start_fingerprint"] == documented_fingerprint(doc, name), name
        assert len(model["weights_sha256"]) == 64


def _warm_starts(block: object, kernels: str | None = None) -> list[tuple[tuple[str, str | None], str]]:
    """Every ((warm-start fingerprint, CPU kernels), weights hash) inside a provenance block.

    The kernels are the model's ``warm_started_on`` (a shipped or pinned copy), else the block's
    ``cpu_capability`` and ``cpu_vendor`` (or the key under ``models_by_cpu``,
    ``graftrl.machine.cpu_kernels()``); None where they were not recorded."""
    if isinstance(block, dict):
        if isinstance(block.get("warm_start_fingerprint"), str):  # a pinned copy names its own kernels
            return [
                (
                    (block["warm_start_fingerprint"], block.get("warm_started_on", kernels)),
                    block["weights_sha256"],
                )
            ]
        if "cpu_capability" in block:
            kernels = " ".join(filter(None, (block["cpu_capability"], block.get("cpu_vendor"))))
        pairs = []
        for key, value in block.items():
            if key == "models_by_cpu":
                pairs += [p for family, models in value.items() for p in _warm_starts(models, family)]
            else:
                pairs += _warm_starts(value, kernels)
        return pairs
    return []


def test_committed_results_agree_on_the_weights_of_each_warm_start():
    """A fingerprint names one set of starting weights per CPU kernels across docs/ and every
    committed experiment's results.json, so results quoted side by side started from the same
    models."""
    weights: dict[tuple[str, str | None], set[str]] = {}
    for path in [*DOCUMENTED, *sorted((DOCS.parent / "experiments").rglob("results.json"))]:
        doc = json.loads(path.read_text())  # a provenance.json is the block itself
        for warm_start, sha in _warm_starts(doc if path in DOCUMENTED else doc.get("provenance", {})):
            weights.setdefault(warm_start, set()).add(sha)
    documented = {f for path in DOCUMENTED for f, _ in _warm_starts(json.loads(path.read_text()))}
    assert documented and len(weights) > len(documented)  # the experiments' own warm-starts count too
    assert {f: shas for f, shas in weights.items() if len(shas) > 1} == {}


def test_results_provenance_hashes_the_weights_and_reads_the_fingerprint(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / REPORT_NAME).write_text(json.dumps({"fingerprint": "abc123"}))
    assert weights_sha256(folder) == hashlib.sha256(b"weights").hexdigest()
    assert model_provenance(folder) == {
        "weights_sha256": hashlib.sha256(b"weights").hexdigest(),
        "warm_start_fingerprint": "abc123",
    }
    (folder / "model-2.safetensors").write_bytes(b"more")
    assert weights_sha256(folder) != hashlib.sha256(b"weights").hexdigest()  # both shards count
    block = results_provenance({"m": folder})
    assert block["models"]["m"]["warm_start_fingerprint"] == "abc123"
    commit = code_commit()
    assert commit == {k: block[k] for k in ("commit", "dirty")}
    # from a git checkout (the tests' case) the commit is a full hash; from a wheel it is None
    assert commit["commit"] is None or len(commit["commit"]) == 40
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        weights_sha256(tmp_path)


def test_reports_name_the_command_and_the_commit_that_wrote_them():
    # the entry point's path is dropped; arguments are quoted as a shell would need them
    assert (
        command_line(["/x/.venv/bin/graftrl", "compare", "--out", "my runs"])
        == "graftrl compare --out 'my runs'"
    )
    assert command_line(["python", "-m", "pytest", "-k", "x"]) == "python -m pytest -k x"
    assert results_provenance({})["command"] == command_line()
    clean = {"command": "graftrl sweep --seeds 5", "commit": "5418d38d7d4c" + "0" * 28, "dirty": False}
    assert signature(clean) == "graftrl sweep --seeds 5 · commit 5418d38d7d"
    assert written_by(clean) == "Written by `graftrl sweep --seeds 5` at commit 5418d38d7d"
    assert signature({**clean, "dirty": True}).endswith("commit 5418d38d7d + uncommitted changes")
    assert written_by({"command": "graftrl demo", "commit": None, "dirty": None}).endswith(
        "at graftrl (no git checkout)"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "path",
    # the code pair's determinism was checked once by hand (docs/task_design.md, "The code task"):
    # its fresh warm-start takes ~9 minutes of the slow tier's budget
    [p for p in DOCUMENTED if json.loads(p.read_text())["task"] != "code"],
    ids=lambda p: str(p.relative_to(DOCS)),
)
def test_documented_warm_start_reproduces_its_weights(path, fresh_embedded_cache):
    """The warm-start is deterministic: the documented fingerprint, trained afresh by the current
    code (into the session's empty cache, which the full demo test then reuses), gives the
    documented weights to the byte (~5 minutes on 2 cores), never from the shipped copy (whose
    bytes tests/test_shipped_weights.py checks against the same hashes)."""
    doc = json.loads(path.read_text())
    paths = prepare_embedded_models(
        fresh_embedded_cache,
        quick=doc["warm_start"] == "quick",
        seed=doc["seed"],
        task=doc["task"],
        shipped=False,
    )
    kernels = cpu_kernels()
    expected = doc.get("models_by_cpu", {}).get(kernels, doc["models"])
    for name, model in expected.items():
        assert model_provenance(paths[name]) == model, (
            f"{name}: the warm-start gives other weights on this machine's CPU kernels ({kernels}); "
            "if the code did not change, add them under models_by_cpu"
        )
