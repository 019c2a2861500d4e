#!/usr/bin/env bash
# The GPU half of the benchmark, for a lent GPU machine (the last stage of scripts/gpu-session.sh, or alone): the
# CUDA transport tests, then one `foresight bench` of ar, sync, pipelined and auto on chat prompts with both workers
# on the one GPU (each its own process and CUDA context: the pipeline's first measurement on a GPU), as served: the
# target's steps and the drafter's passes eager there (compiled steps and CUDA graphs are built for CPUs only so far).
# The report lands in $OUT/gpu-bench.json, the logs in $OUT/session.log.
#
#   OUT=DIR [FS_DEVICE=cuda] [FS_SCALE=full|smoke] [FS_T_BENCH=seconds] [PY=python] bash scripts/gpu-bench.sh
#
# FS_SCALE=smoke runs one prompt of 8 tokens (on a CPU too, FS_DEVICE=cpu): the rehearsal before spending device time.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that collects the results}"
DEVICE=${FS_DEVICE:-cuda}
SCALE=${FS_SCALE:-full}
T_BENCH=${FS_T_BENCH:-240}
if [ -z "${PY:-}" ]; then  # as gpu-session.sh: the `make setup` virtualenv for a CPU rehearsal, else python3
  if [ "$DEVICE" = cpu ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WORK=${FS_WORK:-/tmp/fs-session}
START=$(date +%s)
mkdir -p "$OUT" "$WORK"
LOG="$OUT/session.log"
log() { echo "[gpu-bench +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

if [ "$SCALE" = smoke ]; then SIZE=(--limit 1 --max-tokens 8); else SIZE=(--limit 6 --max-tokens 64); fi

log "CUDA transport tests (skipped without a CUDA device)"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_transport.py -k cuda >>"$LOG" 2>&1
log "transport tests exit $?"

log "bench: ar, sync, pipelined, auto on $DEVICE (both workers)"
timeout "$T_BENCH" "$PY" -m foresight.cli bench --prompts chat "${SIZE[@]}" --temperature 0 \
  --modes ar,sync,pipelined,auto --target-device "$DEVICE" --drafter-device "$DEVICE" \
  --out "$WORK/gpu-bench.json" >>"$LOG" 2>&1
log "bench exit $?"
if [ -f "$WORK/gpu-bench.json" ]; then
  cp "$WORK/gpu-bench.json" "$OUT/gpu-bench.json"
  "$PY" - "$OUT/gpu-bench.json" <<'EOF' 2>>"$LOG" | tee -a "$LOG"
import json, sys
report = json.load(open(sys.argv[1]))
show = lambda value: "-" if value is None else f"{value:.2f}"  # noqa: E731
for mode, row in report["modes"].items():
    print(f"{mode}: {show(row['tokens_per_s'])} tok/s, tau {show(row['tau'])}, verify {show(row['verify_ms_mean'])} ms "
          f"a round, exposed drafting p50 {show(row['exposed_draft_ms_p50'])} ms, hit rate {show(row['hit_rate'])}")
EOF
fi
log "done"
