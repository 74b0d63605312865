#!/usr/bin/env bash
# What a coordinator holds in memory in each mode: the same request served by a coordinator on
# the full file (KVQ_COORDINATOR_EXPERTS=all, then none) and on its backbone file (kvq model
# split --backbone), two workers holding half of the slices each; prints each coordinator's
# /proc status after the request (RSS, anonymous, file-backed, peak) and checks the tokens.
# Usage: examples/backbone_rss.sh [PRESET] (default small, 0.28 GiB). Uses port 6393.
set -euo pipefail
cd "$(dirname "$0")/.."
K=.venv/bin/kvq
work=$(mktemp -d)
preset=${1:-small}
M=$work/$preset.gguf B=$work/$preset-backbone.gguf
$K model make-tiny --preset "$preset" "$M" > /dev/null
$K model split "$M" --backbone "$B"
slices=$($K model inspect "$M" --json | .venv/bin/python -c 'import json,sys; print(len(json.load(sys.stdin)["slices"]))')
export KVQ_REDIS_URL=redis://127.0.0.1:6393/0 KVQ_PREFIX=rss KVQ_JOB_DEADLINE_MS=60000
export KVQ_WORKER_MAX_SLICES=$((slices / 2)) OMP_NUM_THREADS=1
unset KVQ_COORDINATOR_EXPERTS
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; rm -rf "$work"' EXIT
$K server --port 6393 > "$work/server.log" 2>&1 & pids+=($!)
sleep 2
$K monitor --model "rss=$M" > "$work/monitor.log" 2>&1 & pids+=($!)
until grep -q "registered" "$work/monitor.log" 2>/dev/null; do sleep 1; done
for w in w0 w1; do
  $K worker --id $w > "$work/$w.log" 2>&1 & pids+=($!)
done
for w in w0 w1; do
  until grep -q "serving rss" "$work/$w.log" 2>/dev/null; do sleep 1; done
done
P="The quick brown fox"
want=$($K generate --model "$M" --prompt "$P" --max-tokens 16 --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["token_ids"])')
echo "file sizes: full $(stat -c %s "$M") B, backbone $(stat -c %s "$B") B"
run() {  # run LABEL FILE [ENV=VALUE...]: one coordinator, one request, its memory
  local label=$1 file=$2; shift 2
  env "$@" $K coordinator --model "$file" --model-id rss --id "c-$label" > "$work/c-$label.log" 2>&1 &
  local pid=$!
  until grep -q "ready: coordinator" "$work/c-$label.log" 2>/dev/null; do sleep 1; done
  local got
  got=$($K submit --model rss --prompt "$P" --max-tokens 16 --timeout 600 --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["token_ids"])')
  local st
  st=$(grep -E '^(VmRSS|RssAnon|RssFile|VmHWM)' /proc/$pid/status | awk '{printf "%s %.1f MiB  ", $1, $2/1024}')
  echo "$label: $st tokens $([ "$got" = "$want" ] && echo same || echo DIFFERENT)"
  kill $pid; wait $pid 2>/dev/null || true
}
run full-all "$M" KVQ_COORDINATOR_EXPERTS=all
run full-none "$M" KVQ_COORDINATOR_EXPERTS=none
run backbone "$B"
