"""The shipped warm-started pair: it is the pair documented for its CPU kernels, byte for byte; it is
installed into the model cache only on those kernels and only when every file matches its hash; a
rebuild skips it. (The slow tier's provenance test warm-starts the pair afresh and compares with
the hashes documented for the machine's kernels: on the shipped kernels, the shipped bytes.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from graftrl.embedded.models import MODEL_SPECS
from graftrl.embedded.shipped import (
    MANIFEST_NAME,
    REBUILD_ENV,
    SHIPPED_DIR,
    install_shipped,
    ship,
    shipped_kernels,
    shipped_models,
    verify_shipped,
)
from graftrl.embedded.warmstart import REPORT_NAME, prepare_embedded_models
from graftrl.machine import cpu_kernels
from graftrl.reporting.provenance import model_provenance

SHIPPED_TASKS = ("worked", "code")
"""The pairs graftrl ships: the default (`worked`) and the code task's."""


def documented(task: str = "worked") -> dict:
    return json.loads((Path(__file__).parents[1] / "docs" / "demo" / task / "provenance.json").read_text())


@pytest.fixture
def on_shipped_kernels(monkeypatch):
    """This machine as one with the artifact's CPU kernels (where it is installed), no rebuild asked."""
    monkeypatch.setattr("graftrl.embedded.shipped.cpu_kernels", shipped_kernels)
    monkeypatch.delenv(REBUILD_ENV, raising=False)


def test_the_shipped_pairs_are_the_pairs_documented_for_their_kernels():
    manifest = shipped_models()
    docs = [documented(task) for task in SHIPPED_TASKS]
    assert set(manifest) == {
        f"{name}-{m['warm_start_fingerprint']}" for doc in docs for name, m in doc["models"].items()
    }
    for doc in docs:
        for name, expected in doc["models_by_cpu"][shipped_kernels()].items():
            folder = SHIPPED_DIR / f"{name}-{expected['warm_start_fingerprint']}"
            assert verify_shipped(folder, manifest[folder.name]) == []
            assert model_provenance(folder) == {**expected, "warm_started_on": shipped_kernels()}
            assert json.loads((folder / REPORT_NAME).read_text())["reached_target"]


@pytest.mark.parametrize("task", SHIPPED_TASKS)
def test_prepare_installs_the_shipped_pair_without_training(tmp_path, monkeypatch, on_shipped_kernels, task):
    def no_training(*args, **kwargs):
        raise AssertionError("the shipped pair should not be warm-started")

    monkeypatch.setattr("graftrl.embedded.warmstart.warm_start_in_workers", no_training)
    monkeypatch.setattr("graftrl.embedded.warmstart.warm_start", no_training)
    doc = documented(task)
    paths = prepare_embedded_models(tmp_path, seed=doc["seed"], task=doc["task"])
    assert set(paths) == set(MODEL_SPECS)
    for name, path in paths.items():
        assert model_provenance(path) == doc["models_by_cpu"][shipped_kernels()][name]
        AutoModelForCausalLM.from_pretrained(path)
        AutoTokenizer.from_pretrained(path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left
    # the second call is a cache hit: the installed files are not copied again
    stamps = {name: (path / "model.safetensors").stat().st_mtime_ns for name, path in paths.items()}
    assert prepare_embedded_models(tmp_path, seed=doc["seed"], task=doc["task"]) == paths
    assert {name: (p / "model.safetensors").stat().st_mtime_ns for name, p in paths.items()} == stamps


@pytest.fixture
def shipped_copy(tmp_path) -> tuple[Path, str]:
    """A copy of the shipped artifact to damage, and one of its keys."""
    root = tmp_path / "shipped"
    shutil.copytree(SHIPPED_DIR, root)
    return root, sorted(shipped_models(root))[0]


def test_other_cpu_kernels_warm_start_instead(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("graftrl.embedded.shipped.cpu_kernels", lambda: "SSE2 SomeVendor")
    monkeypatch.delenv(REBUILD_ENV, raising=False)
    key = sorted(shipped_models())[0]
    assert not install_shipped(key, tmp_path / key)
    assert not (tmp_path / key).exists()
    assert "SSE2 SomeVendor" in capsys.readouterr().err


def test_a_damaged_artifact_is_refused_and_nothing_is_installed(
    shipped_copy, tmp_path, capsys, on_shipped_kernels
):
    root, key = shipped_copy
    weights = root / key / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    out = tmp_path / "cache" / key
    assert not install_shipped(key, out, root)
    assert not out.exists()
    assert "model.safetensors" in capsys.readouterr().err
    (root / key / REPORT_NAME).unlink()  # a missing file too
    assert sorted(verify_shipped(root / key, shipped_models(root)[key])) == [REPORT_NAME, "model.safetensors"]


def test_a_rebuild_or_an_unshipped_key_installs_nothing(
    shipped_copy, tmp_path, monkeypatch, on_shipped_kernels
):
    root, key = shipped_copy
    monkeypatch.setenv(REBUILD_ENV, "1")
    assert not install_shipped(key, tmp_path / key, root)
    monkeypatch.delenv(REBUILD_ENV)
    assert not install_shipped("llama-char-0000000000000000", tmp_path / "x", root)
    assert install_shipped(key, tmp_path / key, root)
    assert verify_shipped(tmp_path / key, shipped_models(root)[key]) == []


def test_ship_writes_the_folders_and_their_manifest(tmp_path):
    model = tmp_path / "cache" / "llama-char-abc"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"w")
    (model / REPORT_NAME).write_text("{}")
    root = tmp_path / "shipped"
    (root / "gpt2-bpe-old").mkdir(parents=True)  # a folder no longer shipped is removed
    models = ship([model], root)
    assert sorted(p.name for p in root.iterdir()) == sorted([MANIFEST_NAME, "llama-char-abc"])
    assert shipped_models(root) == models
    assert shipped_kernels(root) == cpu_kernels()
    assert set(models["llama-char-abc"]) == {"model.safetensors", REPORT_NAME}
    assert verify_shipped(root / "llama-char-abc", models["llama-char-abc"]) == []


def test_an_experiment_pins_its_starting_weights_and_reuses_them_on_any_kernels(tmp_path, monkeypatch):
    """embedded_task(pin_dir=...): the first call copies the models it prepared into the experiment
    with their hashes; later calls (on any CPU kernels) train from the pinned copy and never prepare;
    another design's weights are not taken for this one; a damaged pinned file is one clear error."""
    from rich.console import Console

    from graftrl.embedded.shipped import PinnedWeightsError, pinned_models
    from graftrl.embedded.warmstart import model_keys
    from graftrl.experiments.compare import task as compare_task

    keys = model_keys(task="worked")  # the default pair, which graftrl ships
    prepared: list[str] = []

    def from_shipped(cache_dir, quick, console, name, mixes, warmstart):
        prepared.append(name)
        return {spec: SHIPPED_DIR / key for spec, key in keys.items()}

    monkeypatch.setattr("graftrl.embedded.base.prepare_models", from_shipped)
    pin = tmp_path / "exp" / "models"
    first = compare_task.embedded_task(
        tmp_path / "exp", None, False, Console(quiet=True), "worked", pin_dir=pin
    )
    assert prepared == ["worked"]
    assert shipped_models(pin) == {key: shipped_models()[key] for key in keys.values()}
    assert {Path(p["path"]).name for p in first.base_config["policies"]} == set(keys.values())
    assert all(Path(p["path"]).parent == pin for p in first.base_config["policies"])

    monkeypatch.setattr("graftrl.embedded.shipped.cpu_kernels", lambda: "SOME OTHER CPU")
    again = compare_task.embedded_task(
        tmp_path / "exp", None, False, Console(quiet=True), "worked", pin_dir=pin
    )
    assert prepared == ["worked"]  # pinned: nothing prepared, whatever this machine's kernels
    assert again.provenance["models"] == first.provenance["models"]
    # results record the kernels the pinned weights were warm-started on, not this machine's
    assert {m["warm_started_on"] for m in again.provenance["models"].values()} == {shipped_kernels()}

    other = model_keys(task="worked", mixes={spec: {"add": 1.0} for spec in MODEL_SPECS})
    assert pinned_models(pin, other) is None  # another design's weights are not this one's

    weights = pin / next(iter(keys.values())) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(PinnedWeightsError, match=r"model\.safetensors fails its SHA-256 check"):
        compare_task.embedded_task(tmp_path / "exp", None, False, Console(quiet=True), "worked", pin_dir=pin)
