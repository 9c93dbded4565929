"""pip's configured package sources as `uv pip install` arguments, one per line.

uv does not read pip's configuration (pip.conf, PIP_* variables), so a machine whose packages come
from a mirror, a local wheel folder (find-links) or under a constraints file would give uv other
sources than pip. This prints pip's index-url, extra-index-url, find-links and constraint settings
as uv's flags, plus the index strategy under which uv, like pip, takes the best version found on
any index. Used by scripts/venv_install.sh.

Usage: python scripts/pip_sources.py [--index-url URL | --extra-index-url URL]
(--index-url replaces pip's index-url; --extra-index-url adds one to pip's extra indexes)
"""

from __future__ import annotations

import ast
import subprocess
import sys

FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def pip_settings() -> dict[str, list[str]]:
    """pip setting -> its values, for the settings in FLAGS (a later scope overrides an earlier one,
    as in pip: config files, then PIP_* variables)."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    settings: dict[str, list[str]] = {}
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        name = key.rpartition(".")[2]
        if name in FLAGS and value:
            settings[name] = str(ast.literal_eval(value)).split()
    return settings


def uv_arguments(
    settings: dict[str, list[str]], index_url: str | None = None, extra_index_url: str | None = None
) -> list[str]:
    if index_url:
        settings = {**settings, "index-url": [index_url]}
    if extra_index_url:
        settings = {**settings, "extra-index-url": [*settings.get("extra-index-url", []), extra_index_url]}
    arguments = ["--index-strategy", "unsafe-best-match"]
    for name, flag in FLAGS.items():
        for value in settings.get(name, [])[: 1 if name == "index-url" else None]:
            arguments += [flag, value]
    return arguments


if __name__ == "__main__":
    given = dict(zip(sys.argv[1::2], sys.argv[2::2], strict=False))
    print("\n".join(uv_arguments(pip_settings(), given.get("--index-url"), given.get("--extra-index-url"))))
