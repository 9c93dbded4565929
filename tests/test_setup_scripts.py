"""The set-up scripts' installer: pip's configured sources handed to uv, and scripts that parse."""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[1] / "scripts"


def _pip_sources():
    spec = importlib.util.spec_from_file_location("pip_sources", SCRIPTS / "pip_sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PIP = {
    "index-url": ["https://mirror.example/simple"],
    "extra-index-url": ["file:///opt/pypi/simple", "file:///opt/more/simple"],
    "find-links": ["/opt/wheels"],
    "constraint": ["/etc/pip/constraints.txt"],
}


def test_pips_sources_become_uvs_flags_under_pips_index_strategy():
    arguments = _pip_sources().uv_arguments(PIP)
    assert arguments[:2] == ["--index-strategy", "unsafe-best-match"]
    pairs = list(zip(arguments[2::2], arguments[3::2], strict=True))
    assert pairs == [
        ("--index-url", "https://mirror.example/simple"),
        ("--extra-index-url", "file:///opt/pypi/simple"),
        ("--extra-index-url", "file:///opt/more/simple"),
        ("--find-links", "/opt/wheels"),
        ("--constraint", "/etc/pip/constraints.txt"),
    ]


def test_a_given_index_replaces_pips_and_an_extra_one_is_added():
    """setup.sh's --index-url (GRAFTRL_TORCH_INDEX for torch) replaces pip's index; setup_vllm.sh's
    --extra-index-url (the same, for vLLM's torch) joins pip's extra indexes."""
    pip_sources = _pip_sources()
    replaced = pip_sources.uv_arguments(PIP, index_url="https://torch.example/cpu")
    assert replaced.count("--index-url") == 1 and "https://torch.example/cpu" in replaced
    assert "https://mirror.example/simple" not in replaced
    extra = pip_sources.uv_arguments(PIP, extra_index_url="https://torch.example/cpu")
    indexes = [v for f, v in itertools.pairwise(extra) if f == "--extra-index-url"]
    assert indexes == [*PIP["extra-index-url"], "https://torch.example/cpu"]
    assert PIP["extra-index-url"] == ["file:///opt/pypi/simple", "file:///opt/more/simple"]  # not mutated


@pytest.mark.parametrize("script", ["setup.sh", "setup_trl.sh", "setup_vllm.sh", "venv_install.sh"])
def test_setup_scripts_parse_and_share_the_installer(script):
    path = SCRIPTS / script
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    if script != "venv_install.sh":
        text = path.read_text()
        assert "source scripts/venv_install.sh" in text and "pip install -q" not in text
