#!/usr/bin/env bash
# Interleaved A/B: old tree ($1) vs new tree ($2); rounds of c=1 and c=8 (CONCS), one server at a time.
# Usage: scripts/ab_bench.sh OLD_TREE NEW_TREE [OUT_DIR]
set -u
A=$1; B=$2; OUT=${3:-/tmp/ab}; mkdir -p $OUT
for round in 1 2 3; do
  for side in A B; do
    tree=$A; [ $side = B ] && tree=$B
    port=31100
    (cd $tree && PYTHONPATH=$tree exec python3 -m tidal.launch_server --port $port --log-level warning > $OUT/server-$side-$round.log 2>&1) &
    pid=$!
    until curl -sf http://127.0.0.1:$port/health >/dev/null; do sleep 1; done
    for c in ${CONCS:-1 8}; do
      (cd $tree && PYTHONPATH=$tree python3 -m tidal.bench --url http://127.0.0.1:$port --num-prompts $((c*4)) \
        --random-input-len 128 --random-output-len 64 --max-concurrency $c --disable-tqdm \
        --output-file $OUT/$side-c$c-r$round.json > /dev/null 2>&1)
    done
    kill -TERM $pid; wait $pid
  done
done
python3 - "$OUT" <<'PY'
import json, glob, statistics, sys
out = sys.argv[1]
for c in (1, 8):
    for side in "AB":
        runs = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{side}-c{c}-r*.json"))]
        if not runs:
            continue
        tput = statistics.median(r["output_throughput"] for r in runs)
        ttft = statistics.median(r["ttft_ms"]["p50"] for r in runs)
        print(f"c={c} {side}: output tok/s median {tput:.1f} (runs {[round(r['output_throughput'],1) for r in runs]}), TTFT p50 {ttft:.0f} ms")
PY
