#!/usr/bin/env bash
# Set up the TRL integration's environment in ./.venv-trl.  Usage: bash scripts/setup_trl.sh
#
# graftrl.integrations.trl subclasses TRL's GRPOTrainer and overrides some of its private methods,
# so it is tested against one TRL range (the `trl` extra in pyproject.toml) with the transformers
# release that range was tested with; it gets a venv of its own, like the vLLM tier, so the main
# ./.venv keeps whatever transformers it resolved to. The `-m trl` test tier runs from here.
#
# Order matters:
# 1. torch first, pinned (GRAFTRL_TORCH, default torch==2.13.0; GRAFTRL_TORCH_INDEX as in
#    scripts/setup.sh, e.g. PyTorch's CPU wheel index on a CPU-only machine), so TRL's resolver
#    finds it satisfied instead of pulling a multi-GB build of its choice;
# 2. graftrl editable with [dev,trl], under constraints that keep torch at the installed version
#    and transformers at the tested release (GRAFTRL_TRANSFORMERS, default transformers==5.24.0).
# A second run only checks what is already satisfied (seconds). Installer: uv, with pip as the
# fallback (scripts/venv_install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv-trl
TORCH_SPEC="${GRAFTRL_TORCH:-torch==2.13.0}"
TRANSFORMERS_SPEC="${GRAFTRL_TRANSFORMERS:-transformers==5.24.0}"
PY="$VENV/bin/python"
source scripts/venv_install.sh
use_venv "$VENV"

if ! "$PY" -m pip show -q torch >/dev/null 2>&1; then
  echo "graftrl trl setup: installing $TORCH_SPEC"
  install ${GRAFTRL_TORCH_INDEX:+--index-url "$GRAFTRL_TORCH_INDEX"} "$TORCH_SPEC"
fi

echo "graftrl trl setup: installing graftrl[dev,trl] (torch kept at the installed version, $TRANSFORMERS_SPEC)"
CONSTRAINT="$(mktemp)"
trap 'rm -f "$CONSTRAINT"' EXIT
"$PY" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" >"$CONSTRAINT"
echo "$TRANSFORMERS_SPEC" >>"$CONSTRAINT"
install -e ".[dev,trl]" -c "$CONSTRAINT"

"$PY" -c "import torch, transformers, trl, graftrl; print(f'graftrl {graftrl.__version__} ready in $VENV: trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}')"
