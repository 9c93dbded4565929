"""Verifiers: a response and its problem row in, a reward and its reason out (``reward.kind``).

``base`` declares the interface (``Verifier``, ``Verdict``, the failure classes); one module per
kind: ``math`` (math_verify in killable worker processes, the default), ``match`` (string and
multiple-choice match), ``function`` (the user's scorer, verl's ``compute_score`` unchanged),
``code`` (Python programs against the row's tests, each run in ``sandbox``'s OS sandbox; the code
that runs inside it is ``sandbox_entry``; ``code_suite`` reads a response's program and a row's
tests and makes the verdict of their results, pure; ``zygote`` keeps a worker's long-lived sandboxes, whose
fork server, ``sandbox_fork``, forks a confined child per program). ``registry`` builds the run's
verifier from its config.
Imports the foundation, storage, config and models.
"""

from graftrl.verifiers.base import FAILURE_CLASSES, Verdict, Verifier, VerifierError
from graftrl.verifiers.registry import VERIFIERS, build_verifier

__all__ = ["FAILURE_CLASSES", "VERIFIERS", "Verdict", "Verifier", "VerifierError", "build_verifier"]
