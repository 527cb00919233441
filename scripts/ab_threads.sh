#!/usr/bin/env bash
# A/B of two checkouts (OLD_TREE NEW_TREE OUT_DIR), one server at a time on port 31300, alternating for
# $ROUNDS rounds: `tidal bench` at c=1 (2 prompts) and c=8 (8 prompts), 128 in / 128 out, plus the API
# process's CPU seconds during each bench and the thread counts of the server's processes after it.
set -u
OLD=$1; NEW=$2; OUT=$3; ROUNDS=${ROUNDS:-2}; mkdir -p $OUT
for round in $(seq $ROUNDS); do for side in old new; do
  tree=$OLD; [ $side = new ] && tree=$NEW
  port=31300
  (cd $tree && PYTHONPATH=$tree exec python3 -m tidal.launch_server --port $port --log-level warning > $OUT/server-$side-$round.log 2>&1) &
  pid=$!
  until curl -sf http://127.0.0.1:$port/health >/dev/null; do sleep 1; done
  api=$(pgrep -f "launch_server --port $port" | head -1)
  for c in ${CONCS:-1 8}; do
    n=$((c == 1 ? 2 : c))
    cpu0=$(awk '{print $14+$15}' /proc/$api/stat)
    t0=$(date +%s.%N)
    (cd $NEW && PYTHONPATH=$NEW python3 -m tidal.bench --url http://127.0.0.1:$port --num-prompts $n \
      --random-input-len 128 --random-output-len 128 --random-range-ratio 1 --max-concurrency $c --disable-tqdm \
      --output-file $OUT/$side-c$c-r$round.json > /dev/null 2>&1)
    t1=$(date +%s.%N)
    cpu1=$(awk '{print $14+$15}' /proc/$api/stat)
    echo "$side r$round c$c api_cpu_s $(echo "($cpu1-$cpu0)/100" | bc -l | cut -c1-5) wall_s $(echo "$t1-$t0" | bc | cut -c1-6) $(python3 $(dirname $0)/proc_threads.py $api | awk '{print "threads", $2}' | tr '\n' ' ')" | tee -a $OUT/log.txt
  done
  kill -TERM $pid; wait $pid
done; done
python3 - "$OUT" <<'PY'
import json, glob, statistics, sys
out = sys.argv[1]
for c in (1, 8):
    med = {}
    for side in ("old", "new"):
        runs = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{side}-c{c}-r*.json"))]
        if not runs:
            continue
        med[side] = statistics.median(r["output_throughput"] for r in runs)
        print(f"c={c} {side}: out tok/s {[round(r['output_throughput'],2) for r in runs]} TTFT p50 {[round(r['ttft_ms']['p50']) for r in runs]} TPOT p50 {[round(r['tpot_ms']['p50'],1) for r in runs]}")
    if len(med) == 2:
        print(f"c={c} new/old throughput ratio {med['new']/med['old']:.2f}")
PY
