#!/usr/bin/env bash
# The GPU measurement, run THERE (the device machine), from the repository root, with OUT set:
#   bash benchmarks/gpu/run.sh            carry: .whl .redis/bin .redis/lib .gpumodel
# Writes to $OUT: gpu_celery.json, gpu_drift.json, their logs, nvidia-smi.txt, logs.tar.gz.
#
# PART=all (default): celery, then drift on the fixture model, then on the wide model, each under
#   its own time limit so that the whole stays inside one 10-minute call (the JSON files are
#   rewritten after every measurement: a step cut off keeps what it had measured).
# PART=1: celery + drift on the fixture model; PART=2: drift on the wide model (two calls).
# SMALL=1: a CPU test of the flow on any machine (--device cpu, few prompts, a narrow wide model);
#   uses $PYTHON (default python3) and, when .redis/bin is absent, the redis-server on PATH.
set -uo pipefail
: "${OUT:?set OUT to the folder for the results}"
PART="${PART:-all}"
SMALL="${SMALL:-0}"
PY="${PYTHON:-python3}"
ROOT="$(pwd)"
mkdir -p "$OUT"
began=$(date +%s)
left() { echo $(( ${BUDGET_S:-570} - ($(date +%s) - began) )); }

# NVLink multicast stays off (KINDS.md): set when unset, never unset.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false

if [ -d .whl ] && [ "$SMALL" != 1 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH="/tmp/site:$ROOT"
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "install: $(( $(date +%s) - began )) s"

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" > "$OUT/nvidia-smi.txt"
head -20 "$OUT/nvidia-smi.txt"
"$PY" -m pip list 2>/dev/null | grep -i -E "^(click|typer|typing.extensions|python-dateutil|rich|pyyaml|jinja2|scipy) " || true
"$PY" -c 'import torch, transformers, celery, redis, pydantic, rapidfuzz, regress.cli; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count(), "transformers", transformers.__version__, "celery", celery.__version__)' \
  || { echo "imports failed"; exit 1; }

REDIS_ARGS=()
if [ -x .redis/bin/redis-server ]; then
  REDIS_ARGS=(--redis-server "$ROOT/.redis/bin/redis-server" --redis-lib "$ROOT/.redis/lib")
  LD_LIBRARY_PATH="$ROOT/.redis/lib" .redis/bin/redis-server --version || { echo "carried redis-server does not start"; exit 1; }
fi

WORK=/tmp/regress-gpu-work
rm -rf "$WORK"; mkdir -p "$WORK"
if [ "$SMALL" = 1 ]; then
  CELERY_ARGS=(--device cpu --prompts 40 --max-tokens 16 --batch 16)
  DRIFT_ARGS=(--device cpu --prompts 40 --max-tokens 16 --batch 16 --wide-hidden 256 --wide-layers 2)
else
  CELERY_ARGS=(--prompts 2000 --max-tokens 32 --batch 64)
  DRIFT_ARGS=(--prompts 512 --max-tokens 32 --batch 64)
fi

status=0
step() {  # step NAME SECONDS command...
  local name=$1 limit=$2; shift 2
  [ "$limit" -gt 20 ] || { echo "== $name: skipped, $limit s left"; status=1; return; }
  echo "== $name (limit ${limit} s, $(( $(date +%s) - began )) s in)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: rc $rc after $(( $(date +%s) - began )) s"
  [ "$rc" = 0 ] || status=1
}

if [ "$PART" = all ] || [ "$PART" = 1 ]; then
  step gpu_celery 150 "$PY" benchmarks/gpu_celery.py "${CELERY_ARGS[@]}" "${REDIS_ARGS[@]}" \
    --work "$WORK/celery" --out "$OUT/gpu_celery.json"
  lim=$(left); [ "$PART" = all ] && [ "$SMALL" != 1 ] && lim=$(( lim < 200 ? lim : 200 ))
  step gpu_drift_fixture "$lim" "$PY" benchmarks/gpu_drift.py "${DRIFT_ARGS[@]}" --models fixture \
    --work "$WORK/drift" --out "$OUT/gpu_drift_fixture.json"
fi
if [ "$PART" = all ] || [ "$PART" = 2 ]; then
  step gpu_drift_wide "$(left)" "$PY" benchmarks/gpu_drift.py "${DRIFT_ARGS[@]}" --models wide \
    --work "$WORK/drift" --out "$OUT/gpu_drift_wide.json"
fi

# Worker, redis and engine logs, for whatever went wrong (small: no runs, no models).
(cd "$WORK" && find . -name '*.log' -size -4M | tar czf "$OUT/logs.tar.gz" -T -) 2>/dev/null || true
echo "total: $(( $(date +%s) - began )) s, status $status"
ls -la "$OUT"
exit $status
