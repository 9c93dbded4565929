# The set-up scripts' installer (sourced by setup.sh, setup_trl.sh and setup_vllm.sh):
#   use_venv DIR          create the venv DIR unless it exists, pick the installer; sets VENV_PY
#   install [--index-url URL | --extra-index-url URL] REQUIREMENT...   install into it
#
# Installer: uv, itself pip-installed into the venv (seconds). It installs the same releases as pip
# from the same sources in a fraction of the time (benchmarks/README.md, "The first command"), but
# does not read pip's configuration: scripts/pip_sources.py passes pip's indexes, find-links and
# constraints on. GRAFTRL_INSTALLER=pip uses pip alone; so does any uv failure.

use_venv() {
  VENV_PY="$1/bin/python"
  if [[ ! -x "$VENV_PY" ]]; then
    "${PYTHON:-python3}" -m venv "$1"
  fi
  INSTALLER="${GRAFTRL_INSTALLER:-uv}"
  if [[ "$INSTALLER" == uv ]] && ! "$VENV_PY" -m uv --version >/dev/null 2>&1 \
    && ! "$VENV_PY" -m pip install -q uv >/dev/null 2>&1; then
    echo "graftrl setup: uv could not be installed; installing with pip"
    INSTALLER=pip
  fi
  if [[ "$INSTALLER" == pip ]]; then
    "$VENV_PY" -m pip install -q --upgrade pip
  fi
}

install() {
  local source=()
  if [[ "$1" == --index-url || "$1" == --extra-index-url ]]; then
    source=("$1" "$2")
    shift 2
  fi
  if [[ "$INSTALLER" == uv ]]; then
    local sources
    mapfile -t sources < <("$VENV_PY" scripts/pip_sources.py "${source[@]}")
    if "$VENV_PY" -m uv pip install --quiet --compile-bytecode --python "$VENV_PY" \
      "${sources[@]}" "$@"; then
      return
    fi
    echo "graftrl setup: uv failed; installing with pip"
    INSTALLER=pip
  fi
  "$VENV_PY" -m pip install -q "${source[@]}" "$@"
}
