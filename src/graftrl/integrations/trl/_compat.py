"""Which TRL the integration runs on: the tested range is the ``trl`` extra in pyproject.toml."""

from __future__ import annotations

import os
from importlib import metadata
from typing import Any

from graftrl.errors import UserError

INSTALL_HINT = "bash scripts/setup_trl.sh (or pip install -e '.[trl]' in a graftrl clone)"
UNTESTED_ENV = "GRAFTRL_TRL_UNTESTED"
"""Set to 1 to run on a TRL outside the tested range (the integration overrides TRL internals)."""


class TRLIntegrationError(UserError):
    """TRL, its version or a trainer configuration the integration does not support."""


class TRLUnavailableError(TRLIntegrationError, ImportError):
    """TRL is not installed (an ImportError too, so ``from ... import`` reports it as one)."""


def tested_range() -> str:
    """The TRL specifier of graftrl's ``trl`` extra (e.g. ``>=1.16,<1.17``), from the installed
    package's metadata; empty when graftrl runs from a source tree without metadata."""
    try:
        requirements = metadata.requires("graftrl") or []
    except metadata.PackageNotFoundError:
        return ""
    from packaging.requirements import Requirement

    for line in requirements:
        requirement = Requirement(line)
        marker = requirement.marker
        # the `trl` extra's requirement (not bench's: its marker names another extra)
        if requirement.name == "trl" and marker is not None and marker.evaluate({"extra": "trl"}):
            return str(requirement.specifier)
    return ""


def require_trl() -> Any:
    """The ``trl`` module, after checking its version against the tested range (one-line errors)."""
    try:
        import trl
    except ImportError as error:
        raise TRLUnavailableError(
            f"graftrl.integrations.trl needs TRL ({error}); install it with {INSTALL_HINT}"
        ) from None
    from packaging.specifiers import SpecifierSet

    spec = tested_range()
    if spec and trl.__version__ not in SpecifierSet(spec) and os.environ.get(UNTESTED_ENV) != "1":
        raise TRLIntegrationError(
            f"TRL {trl.__version__} is outside the range graftrl.integrations.trl is tested with (trl{spec}); "
            f"install a tested one with {INSTALL_HINT}, or set {UNTESTED_ENV}=1 to try this one"
        )
    return trl
