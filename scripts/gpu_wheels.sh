#!/usr/bin/env bash
# Make .whl/: the wheels graftrl needs on the GPU machine (python3 3.12, x86-64, no registry
# there), which scripts/gpu_check.sh installs. Run it in graftrl's venv, with PyPI reachable:
#
#   bash scripts/gpu_wheels.sh        # -> .whl/ (git-ignored; carry it, benchmarks/README.md "GPU check")
#
# The list is computed (scripts/gpu_check.py wheels): graftrl's requirements that the machine's
# image lacks, and theirs, at the versions installed in this venv; binary wheels for CPython 3.12
# on manylinux x86-64 or pure Python. It fails when a wheel is missing or the folder passes 16 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-.venv/bin/python}" scripts/gpu_check.py wheels --download "${GRAFTRL_WHEEL_DIR:-.whl}"
