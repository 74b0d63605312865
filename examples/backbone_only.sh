#!/usr/bin/env bash
# A backbone-only coordinator (on a file written by `kvq model split --backbone`: no routed
# expert in its memory) and two workers, each holding half of every layer's experts, fetched
# from the full file the monitor registered, against `kvq generate` on the full file: the
# greedy tokens must be equal. Usage: examples/backbone_only.sh [MODEL.gguf] (default: writes the OLMoE-1B-7B preset,
# 4.2 GB, to $TMPDIR). Needs a checkout with .venv (make setup); uses port 6391.
set -euo pipefail
cd "$(dirname "$0")/.."
K=.venv/bin/kvq
work=$(mktemp -d)
M=${1:-$work/olmoe.gguf}
[ -f "$M" ] || $K model make-tiny --preset olmoe-1b-7b "$M"
experts=$($K model inspect "$M" --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["expert_count"])')
layers=$($K model inspect "$M" --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["block_count"])')
export KVQ_REDIS_URL=redis://127.0.0.1:6391/0 KVQ_PREFIX=bo
unset KVQ_COORDINATOR_EXPERTS  # implied by the backbone file (all would be refused)
export KVQ_SLICE_LAYERS=$layers KVQ_SLICE_EXPERTS=$((experts / 2)) KVQ_JOB_DEADLINE_MS=120000
export OMP_NUM_THREADS=1
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; rm -rf "$work"' EXIT
$K server --port 6391 > "$work/server.log" 2>&1 & pids+=($!)
sleep 2
$K monitor --model "bo=$M" > "$work/monitor.log" 2>&1 & pids+=($!)
until grep -q "registered" "$work/monitor.log" 2>/dev/null; do sleep 1; done
# both at once: a loading worker heartbeats, so neither is reaped while it downloads
for w in w0 w1; do
  $K worker --id $w > "$work/$w.log" 2>&1 & pids+=($!)
done
for w in w0 w1; do
  until grep -q "serving bo" "$work/$w.log" 2>/dev/null; do sleep 1; done
done
$K model split "$M" --backbone "$work/backbone.gguf"
$K coordinator --model "$work/backbone.gguf" --model-id bo --id c1 > "$work/coord.log" 2>&1 & pids+=($!)
until grep -q "ready: coordinator" "$work/coord.log" 2>/dev/null; do sleep 1; done
P="The quick brown fox"
remote=$($K submit --model bo --prompt "$P" --max-tokens 8 --timeout 900 --json)
local_=$($K generate --model "$M" --prompt "$P" --max-tokens 8 --json)
ids() { .venv/bin/python -c 'import json,sys; print(json.loads(sys.argv[1])["token_ids"])' "$1"; }
echo "remote: $(ids "$remote")"
echo "local:  $(ids "$local_")"
[ "$(ids "$remote")" = "$(ids "$local_")" ] && echo "same greedy tokens" || { echo "DIFFERENT"; exit 1; }
