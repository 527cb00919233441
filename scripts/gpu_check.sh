#!/usr/bin/env bash
# The checks a machine with a CUDA GPU owes tidal: the opt-in parity tests (`pytest -m gpu`), then
# `tidal bench` against a `--device cuda` server and transformers `generate` on the same GPU,
# 128-token random prompts, 128 new tokens, concurrency / batch 1, 8, 32, 128.
# Usage: bash scripts/gpu_check.sh [OUTDIR]   (tidal's dependencies installed; default OUTDIR bench_results/gpu;
# DEVICE=cpu CONCURRENCY="1" tries the script itself on a machine without a GPU)
# Budget: ~2 min of tests (transformers on the GPU, two servers, one compiles its decode step) and a few
# minutes of bench: an eager decode step of this small model costs tens of ms of Python on a slow host CPU.
set -u
out=${1:-bench_results/gpu}
port=${PORT:-30000}
mkdir -p "$out"
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
levels=${CONCURRENCY:-1 8 32 128}
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$out/gpu.txt"
$py -m pytest -m gpu tests/test_gpu.py -q -rA -p no:cacheprovider 2>&1 | tail -6 | tee "$out/pytest_gpu.txt"

$py -m tidal.launch_server --host 127.0.0.1 --port "$port" --device "$device" --max-running-requests 128 \
    > "$out/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
ready=0
for _ in $(seq 600); do
    if $py -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health', timeout=2).status_code != 200)" \
        2>/dev/null; then ready=1; break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 0.5
done
[ $ready = 1 ] || { echo "the $device server did not start: see $out/server.log"; exit 1; }
for c in $levels; do
    n=$((c * 3 > 4 ? c * 3 : 4))
    timeout 600 $py -m tidal.cli bench --url "http://127.0.0.1:$port" --random-input-len 128 --random-output-len 128 \
        --random-range-ratio 1 --max-concurrency $c --num-prompts $n --warmup-requests 2 --disable-tqdm \
        --output-file "$out/tidal_c$c.json" > "$out/tidal_c$c.txt" 2>&1
    echo "concurrency $c (rc $?):"
    grep -E "Failed|Output token throughput|P50 TTFT|P99 TTFT|P50 TPOT|P99 TPOT" "$out/tidal_c$c.txt"
done
kill $pid; wait $pid 2>/dev/null; trap - EXIT
timeout 600 $py -m tidal.bench.hf_baseline --device "$device" --batch-sizes $levels --input-len 128 --output-len 128 \
    --dtype bfloat16 --output-file "$out/hf_bf16.json" 2>&1 | tail -3
