#!/usr/bin/env bash
# Set up graftrl in ./.venv.  Usage: bash scripts/setup.sh [--dev]
#
# PyTorch is installed first and pinned (torch==2.13.0 unless GRAFTRL_TORCH says otherwise):
# - on a machine with an NVIDIA driver, pip's default wheel is the CUDA build;
# - on a CPU-only machine, set GRAFTRL_TORCH_INDEX to PyTorch's CPU wheel index to avoid the
#   multi-GB CUDA download (machines with a local CPU wheel via pip's find-links need nothing).
# A torch that is already installed in the venv is kept.
#
# Installer: uv, with pip as the fallback (scripts/venv_install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${GRAFTRL_TORCH:-torch==2.13.0}"
EXTRAS=""
[[ "${1:-}" == "--dev" ]] && EXTRAS="[dev]"

source scripts/venv_install.sh
use_venv .venv

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "graftrl setup: installing $TORCH_SPEC"
  install ${GRAFTRL_TORCH_INDEX:+--index-url "$GRAFTRL_TORCH_INDEX"} "$TORCH_SPEC"
fi

echo "graftrl setup: installing graftrl$EXTRAS"
install -e ".$EXTRAS"
.venv/bin/python -c "import torch, graftrl; print(f'graftrl {graftrl.__version__} ready: torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
