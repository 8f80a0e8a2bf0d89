#!/usr/bin/env bash
# Served DeepSeek-V4-Flash:4 under one graph mode with the step-plan log on: the 1024/128
# workload at 4 req/s and unbounded, then the shared-prefix workload at 4 req/s. Each load's
# wall-clock window goes to $OUT/loads.log and its requests (TTFT, cached tokens) to
# $OUT/load-NAME.json, so that tools/step_times.py --window splits the step log
# ($OUT/steps.jsonl) by load; the server's TTFT, queue and prefill histograms after each load
# go to $OUT/metrics-NAME.txt (cumulative: subtract the load before).
#
#   tools/served_steps.sh [GRAPH_MODE]      (default full)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
AFD="python -m afdserve.cli"
PORT=8123
MODE=${1:-full}
python -c "import fastapi, uvicorn, prometheus_client" 2>/dev/null ||
    python -m pip install -q --no-index --find-links .whl fastapi uvicorn httpx prometheus-client
dir=/tmp/preset-v4-steps
[ -f $dir/config.json ] || $AFD make-config --preset "${V4:-deepseek-v4-flash:4}" $dir >/dev/null
$AFD serve $dir --load-format dummy --disable-log-requests --port $PORT --max-model-len 8192 \
    --graph-mode "$MODE" --log-step-plan "$OUT/steps.jsonl" >"$OUT/server.log" 2>&1 &
pid=$!
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $pid 2>/dev/null || break
    sleep 1
done
load() {  # load NAME FLAGS...
    local name=$1 start
    shift
    start=$(date +%s.%N)
    # shellcheck disable=SC2068
    $AFD bench serve --base-url "http://127.0.0.1:$PORT" --model-dir $dir $@ \
        --json "$OUT/load-$name.json" >>"$OUT/loads.log" 2>&1
    echo "window $name $start $(date +%s.%N)" | tee -a "$OUT/loads.log"
    # The server's own split of the first token's wait (cumulative over the loads so far):
    # from the HTTP arrival (TTFT), queued at the rank (queue time), and its prefill.
    curl -s "http://127.0.0.1:$PORT/metrics" |
        grep -E '^vllm:(time_to_first_token|request_queue_time|request_prefill_time)_seconds' \
            >"$OUT/metrics-$name.txt"
}
load rate4 --input-len 1024 --output-len 128 --request-rate 4 --num-prompts 40
load unbounded --input-len 1024 --output-len 128 --request-rate inf --num-prompts 80
load prefix --num-prefixes 16 --prefix-len 2048 --input-len 64 --output-len 128 \
    --request-rate 4 --num-prompts 40
kill -INT $pid
wait $pid
