#!/usr/bin/env bash
# Set up graftrl in ./.venv.  Usage: bash scripts/setup.sh [--dev]
#
# PyTorch is installed first and pinned (torch==2.13.0 unless GRAFTRL_TORCH says otherwise):
# - on a machine with an NVIDIA driver, pip's default wheel is the CUDA build;
# - on a CPU-only machine, set GRAFTRL_TORCH_INDEX to PyTorch's CPU wheel index to avoid the
#   multi-GB CUDA download (machines with a local CPU wheel via pip's find-links need nothing).
# A torch that is already installed in the venv is kept.
#
# Installer: uv, itself pip-installed into the venv (seconds). It installs the same releases as pip
# from the same sources in a fraction of the time (benchmarks/README.md, "The first command"), but
# does not read pip's configuration: scripts/pip_sources.py passes pip's indexes, find-links and
# constraints on. GRAFTRL_INSTALLER=pip uses pip alone; so does any uv failure.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${GRAFTRL_TORCH:-torch==2.13.0}"
EXTRAS=""
[[ "${1:-}" == "--dev" ]] && EXTRAS="[dev]"

if [[ ! -x .venv/bin/python ]]; then
  "$PYTHON" -m venv .venv
fi

INSTALLER="${GRAFTRL_INSTALLER:-uv}"
if [[ "$INSTALLER" == uv ]] && ! .venv/bin/python -m uv --version >/dev/null 2>&1 \
  && ! .venv/bin/python -m pip install -q uv >/dev/null 2>&1; then
  echo "graftrl setup: uv could not be installed; installing with pip"
  INSTALLER=pip
fi
[[ "$INSTALLER" == pip ]] && .venv/bin/python -m pip install -q --upgrade pip

install() {  # install [--index-url URL] REQUIREMENT... into .venv
  local index=()
  if [[ "$1" == --index-url ]]; then index=(--index-url "$2"); shift 2; fi
  if [[ "$INSTALLER" == uv ]]; then
    local sources
    mapfile -t sources < <(.venv/bin/python scripts/pip_sources.py "${index[@]}")
    if .venv/bin/python -m uv pip install --quiet --compile-bytecode --python .venv/bin/python \
      "${sources[@]}" "$@"; then
      return
    fi
    echo "graftrl setup: uv failed; installing with pip"
    INSTALLER=pip
  fi
  .venv/bin/python -m pip install -q "${index[@]}" "$@"
}

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "graftrl setup: installing $TORCH_SPEC"
  install ${GRAFTRL_TORCH_INDEX:+--index-url "$GRAFTRL_TORCH_INDEX"} "$TORCH_SPEC"
fi

echo "graftrl setup: installing graftrl$EXTRAS"
install -e ".$EXTRAS"
.venv/bin/python -c "import torch, graftrl; print(f'graftrl {graftrl.__version__} ready: torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
