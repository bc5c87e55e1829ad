#!/usr/bin/env bash
# One prepared GPU check (one H200, under 8 minutes): the gpu-marked tests, then per-step
# latency at Llama-3.1-8B shapes and method throughput with random weights (scripts/gpu_bench.py).
# Everything it reports lands in $OUT (at most 5 files): check.log, pytest_gpu.log, bench.log,
# results.json, summary.md. A failing step is logged and the next one still runs; the exit
# status is that of the first failing step.
#
#   OUT=/tmp/gc bash scripts/gpu_check.sh               # on the GPU machine
#   OUT=/tmp/gc DRY_RUN=1 bash scripts/gpu_check.sh     # CPU smoke test of this script (< 1 min)
#
# PYTHON picks the interpreter (default: .venv/bin/python when present, else python3); the
# repository goes on PYTHONPATH, so nothing needs installing. Budgets (seconds) can be
# overridden: TEST_BUDGET (default 120), BENCH_BUDGET (default 270; the bench stops starting
# new work at 85% of it and is killed 60 s after it). Worst case: 10 + 120 + 330 s < 8 min.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:?set OUT to the folder that receives the results}"
mkdir -p "$OUT"
DRY_RUN="${DRY_RUN:-0}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
TEST_BUDGET="${TEST_BUDGET:-120}"
BENCH_BUDGET="${BENCH_BUDGET:-270}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LOG="$OUT/check.log"
: >"$LOG"
STATUS=0
T0=$(date +%s)

log() { echo "[gpu_check $(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }

step() {  # step NAME BUDGET_S LOGFILE CMD...: run with a time limit; record, never abort
  local name="$1" budget="$2" out="$3" rc=0
  shift 3
  log "start $name (limit ${budget}s): $*"
  timeout --signal=TERM --kill-after=10 "$budget" "$@" >>"$out" 2>&1 || rc=$?
  if [[ $rc -eq 0 ]]; then
    log "ok    $name"
  else
    [[ $rc -eq 124 ]] && log "TIMEOUT $name after ${budget}s" || log "FAIL  $name (exit $rc)"
    [[ $STATUS -eq 0 ]] && STATUS=$rc
  fi
}

log "root=$ROOT python=$PYTHON dry_run=$DRY_RUN"
step env 60 "$LOG" "$PYTHON" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory >> 30, "GiB")
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:  # the kernels fall back to torch without it
    print("triton missing:", exc)
PY
if command -v nvidia-smi >/dev/null; then nvidia-smi >>"$LOG" 2>&1 || true; fi

if [[ "$DRY_RUN" == "1" ]]; then
  # On a CPU every gpu test skips; the interpreter tests of the kernels run instead.
  step tests 120 "$OUT/pytest_gpu.log" "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels
  step bench 120 "$OUT/bench.log" "$PYTHON" scripts/gpu_bench.py --dry-run --out "$OUT" --budget-s 60
else
  step tests "$TEST_BUDGET" "$OUT/pytest_gpu.log" "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu \
    --continue-on-collection-errors tests/kernels tests/vocab tests/models tests/decoding
  step bench "$((BENCH_BUDGET + 60))" "$OUT/bench.log" "$PYTHON" scripts/gpu_bench.py --out "$OUT" \
    --budget-s "$((BENCH_BUDGET * 85 / 100))"
fi

tail -n 3 "$OUT/pytest_gpu.log" | sed 's/^/  pytest: /' | tee -a "$LOG" || true
[[ -f "$OUT/summary.md" ]] && tee -a "$LOG" <"$OUT/summary.md"
log "done in $(($(date +%s) - T0))s, status $STATUS"
exit "$STATUS"
