#!/bin/bash
# Issue 10 item 4: a live 3-server run (1 prefill, 1 decode, 1 null; static layout) driven by the
# Azure conversation trace, then `tidal sim calibrate` on its bench JSON.
#   scripts/calibrate_live.sh OUT_DIR [extra tidal bench flags]
# Run from the repository root (PYTHONPATH=$PWD when the editable install is elsewhere).
set -euo pipefail
out=${1:?usage: calibrate_live.sh OUT_DIR [bench flags]}; shift
mkdir -p "$out"
port=${PORT:-18700}
python3 -m tidal.cli cluster --prefill 1 --decode 1 --worker 1 --planner static --port "$port" \
  --base-port $((port + 1)) --bootstrap-base-port $((port + 10)) > "$out/cluster.log" 2>&1 &
cluster=$!
trap 'kill $cluster 2>/dev/null; wait $cluster 2>/dev/null || true' EXIT
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
echo "load before: $(cat /proc/loadavg)" | tee "$out/load.txt"
python3 scripts/cpu_split.py snapshot "$out/cpu_before.json"
python3 -m tidal.cli bench --url "http://127.0.0.1:$port" --dataset azure-conv --num-prompts 100 \
  --trace-speedup 0.15 --max-input-len 384 --max-output-len 96 --warmup-requests 2 --disable-tqdm \
  --output-file "$out/live.json" "$@" | tee "$out/bench.txt"
echo "load after: $(cat /proc/loadavg)" | tee -a "$out/load.txt"
python3 scripts/cpu_split.py snapshot "$out/cpu_after.json"
python3 scripts/cpu_split.py diff "$out/cpu_before.json" "$out/cpu_after.json" | tee "$out/cpu_split.json"
kill $cluster; wait $cluster || true
trap - EXIT
for profile in smollm2_cpu_1thread smollm2_cpu_2core; do
  python3 -m tidal.cli sim calibrate --bench-json "$out/live.json" --prefill 1 --decode 1 --null 1 \
    --profile "tidal/profile/data/$profile.json" --host-cores 2 --output "$out/calib_$profile.json" || true
done
