#!/usr/bin/env bash
# 1P1D tidal cluster, pinned (default) vs --disable-cpu-pinning, alternating, 2 rounds; tidal bench via the
# router at c=1 (2 prompts) and c=8 (8 prompts), 128 in / 128 out. Usage: scripts/ab_cluster_pinning.sh OUT_DIR [TREE]
set -u
T=$(realpath "${2:-.}"); OUT=$1; mkdir -p $OUT
for round in 1 2; do for side in pinned unpinned; do
  extra=""; [ $side = unpinned ] && extra="--disable-cpu-pinning"
  (cd $T && PYTHONPATH=$T exec python3 -m tidal.cli cluster --prefill 1 --decode 1 --port 31400 --base-port 31410 \
     --bootstrap-base-port 31420 $extra --server-args "--log-level warning" > $OUT/cluster-$side-$round.log 2>&1) &
  pid=$!
  until curl -sf http://127.0.0.1:31400/health >/dev/null; do sleep 1; done
  for c in 1 8; do
  n=$((c == 1 ? 2 : 8))
  (cd $T && PYTHONPATH=$T python3 -m tidal.bench --url http://127.0.0.1:31400 --num-prompts $n --random-input-len 128 \
     --random-output-len 128 --random-range-ratio 1 --max-concurrency $c --disable-tqdm --output-file $OUT/$side-c$c-r$round.json > /dev/null 2>&1)
  python3 -c "import json; r=json.load(open('$OUT/$side-c$c-r$round.json')); print('$side r$round c$c', round(r['output_throughput'],2), 'ttft p50', round(r['ttft_ms']['p50']), 'tpot p50', round(r['tpot_ms']['p50'],1))" | tee -a $OUT/log.txt
  done
  kill -TERM $pid; wait $pid
done; done
