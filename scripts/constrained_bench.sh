#!/usr/bin/env bash
# Cost of constrained decoding: one `tidal serve` (defaults), rounds of unconstrained / regex /
# JSON-schema requests interleaved at concurrency C (default 8), 128 prompt tokens, up to 64 out.
# Usage: scripts/constrained_bench.sh [OUT_DIR] [ROUNDS]
set -u
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/constrained_bench}; ROUNDS=${2:-3}; C=${C:-8}; PORT=${PORT:-31200}; mkdir -p $OUT
REGEX='{"regex": "[A-Za-z ,.]+"}'
JSON='{"json_schema": {"type": "object", "properties": {"title": {"type": "string"}, "words": {"type": "array", "items": {"type": "string"}}}, "required": ["title", "words"]}}'
PYTHONPATH=$PWD python3 -m tidal.launch_server --port $PORT --log-level warning > $OUT/server.log 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
until curl -sf http://127.0.0.1:$PORT/health >/dev/null; do sleep 1; done
for round in $(seq $ROUNDS); do
  for kind in none regex json; do
    extra=(); [ $kind = regex ] && extra=(--extra-request-body "$REGEX"); [ $kind = json ] && extra=(--extra-request-body "$JSON")
    PYTHONPATH=$PWD python3 -m tidal.bench --url http://127.0.0.1:$PORT --num-prompts $((C*4)) --warmup-requests 2 \
      --random-input-len 128 --random-output-len 64 --max-concurrency $C --disable-tqdm "${extra[@]}" \
      --output-file $OUT/$kind-r$round.json > /dev/null 2>&1
    echo "round $round $kind: load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
python3 - "$OUT" <<'PY'
import json, glob, statistics, sys
out = sys.argv[1]
base = None
for kind in ("none", "regex", "json"):
    runs = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{kind}-r*.json"))]
    tput = statistics.median(r["output_throughput"] for r in runs)
    toks = statistics.median(r["total_output_tokens"] if "total_output_tokens" in r else 0 for r in runs)
    base = base or tput
    print(f"{kind:6s} output tok/s median {tput:6.1f} ({tput / base:.3f}x) runs {[round(r['output_throughput'], 1) for r in runs]} "
          f"output tokens {toks}")
PY
