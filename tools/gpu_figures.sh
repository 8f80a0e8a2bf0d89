#!/usr/bin/env bash
# The GPU figures the open issues still ask for, as named groups of runs, each meant to fit one
# device call of 10 minutes on one H100/H200 (`families` may not: give it fewer presets through
# FAMILIES="a b"). docs/benchmarks.md records each figure with the command this ran.
#
#   tools/gpu_figures.sh GROUP [GROUP ...]      logs under $OUT (default ./gpu-out), one per run
#
# Groups:
#   v4-serve-auto, v4-serve-full   served DeepSeek-V4-Flash:4 (issue 42/44): 1024 in / 128 out at
#                                  4 req/s and unbounded, the 16 x 2048 shared-prefix workload
#                                  with prefix caching on and off, under that graph mode
#   v4-prefix-full                 the shared-prefix workload alone, prefix caching on and off,
#                                  under `full`
#   v4-generate                    `bench generate` on the same workload (the served ratio), and
#                                  one 1024-token prefill step (the TTFT yardstick)
#   v4-kernels                     bench decode at contexts 8192 and 65536, the decode profile at
#                                  batch 1 and 64, an 8192-token prefill profile (issue 43)
#   v4-prefill                     mHC's mixing kernels by row count, then the 8192-token
#                                  prefill profile: as it is, with the earlier per-row mix and
#                                  16-head attention (the before), and 32 heads (issue 43)
#   fp4                            the FP4 experts: the prefill ways against the decode kernels,
#                                  and the decode kernels' tile sweep at 64 rows (issue 43)
#   fp4-ws                         the warp-specialized FP4 kernel against the shipped gate/up
#                                  kernel (tools/fp4_ws_bench.py; issue 43, twenty-third session)
#   qwen-serve                     Qwen3-30B-A3B served with defaults, 200 prompts (issue 44)
#   families                       bench decode of each new family's preset (issues 45, 46)
#   gpt-oss                        gpt-oss-120b:8 decode and its batch-64 profile after the FP4
#                                  K tail, deepseek-v3.2:4's batch-64 profile (issue 45)
#   capacity                       bench capacity at 32768, hybrid against plain KV (issue 46)
#   spec                           speculation: n-gram on the repetitive workload, MTP's
#                                  verification step against a plain one (issue 47)
#   fp8                            Qwen3-30B-A3B decode, bf16 and FP8 (issue 49)
#   gpu-tests                      the GPU tests of the layers changed since their last GPU run
#   v4-steps                       served V4 under `full` with the step log on: 4 req/s,
#                                  unbounded, the shared prefixes (tools/step_times.py --window
#                                  with windows.log splits v4-steps.jsonl by load; metrics.log
#                                  holds the server's TTFT, queue and prefill histograms)
#   next                           the V4 GPU tests (with the mHC and norm-rotary tests past
#                                  2^31 elements: passed on an H100 in the twenty-third
#                                  session; a cold Triton cache needs more than 200 s for the
#                                  two files), then issue 43's table for an H200 (decode at
#                                  8192 and 65536, colocated and in-process, the FP4
#                                  experts' share, the 8192-token prefill), which has run
#                                  on H100s only since the twelfth session
#
# Each load's wall-clock window goes to windows.log, the server's TTFT split after it to
# metrics.log. More than 8 files under $OUT are packed into one gpu-figures.tgz at the end (a
# device call brings back 8).
#
# The server needs fastapi, uvicorn and pydantic: where the device lacks them, carry their
# wheels in ./.whl (pip download --python-version 3.12 --only-binary :all: -d .whl fastapi
# uvicorn prometheus-client) and this installs them first.
set -uo pipefail
cd "$(dirname "$0")/.."
# The tools import afdserve from this tree (`python tools/x.py` puts only tools/ on the path).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
AFD="python -m afdserve.cli"
PORT=8123
V4=${V4:-deepseek-v4-flash:4}

log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/index.log"; }

run() {  # run NAME CMD...: its output to $OUT/NAME.log, its tail to the index
    local name=$1
    shift
    log "$name: $*"
    "$@" >"$OUT/$name.log" 2>&1
    echo "rc=$?" >>"$OUT/$name.log"
    tail -n 12 "$OUT/$name.log" | tee -a "$OUT/index.log"
}

wheels() {
    python -c "import fastapi, uvicorn, prometheus_client" 2>/dev/null && return
    [ -d .whl ] && python -m pip install -q --no-index --find-links .whl fastapi uvicorn httpx prometheus-client && return
    log "no fastapi/uvicorn here and no ./.whl to install them from: server groups skipped"
    return 1
}

preset_dir() {  # preset_dir NAME[:LAYERS] -> a model dir for --load-format dummy
    local dir="/tmp/preset-${1//[:.]/-}"
    [ -f "$dir/config.json" ] || $AFD make-config --preset "$1" "$dir" >/dev/null
    echo "$dir"
}

serve_and_load() {  # serve_and_load NAME DIR "SERVE FLAGS" "BENCH FLAGS"...
    local name=$1 dir=$2 flags=$3
    shift 3
    # shellcheck disable=SC2086
    $AFD serve "$dir" --load-format dummy --disable-log-requests --port $PORT $flags \
        >"$OUT/$name-server.log" 2>&1 &
    local pid=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
        kill -0 $pid 2>/dev/null || break
        sleep 1
    done
    local i=0 start
    for load in "$@"; do
        i=$((i + 1))
        start=$(date +%s.%N)
        # shellcheck disable=SC2086
        run "$name-$i" $AFD bench serve --base-url "http://127.0.0.1:$PORT" --model-dir "$dir" \
            $load --json "$OUT/$name-$i.json"
        # The load's wall-clock window (tools/step_times.py --window splits a step log by it),
        # and the server's own split of the first token's wait so far (cumulative histograms:
        # from the HTTP arrival, queued at the rank, the prefill).
        echo "window $name-$i $start $(date +%s.%N)" >>"$OUT/windows.log"
        curl -s "http://127.0.0.1:$PORT/metrics" |
            grep -E '^vllm:(time_to_first_token|request_queue_time|request_prefill_time)_seconds' |
            sed "s/^/$name-$i /" >>"$OUT/metrics.log"
    done
    kill -INT $pid 2>/dev/null
    wait $pid 2>/dev/null
    tail -n 5 "$OUT/$name-server.log" >>"$OUT/index.log"
}

PREFIXED="--num-prefixes 16 --prefix-len 2048 --input-len 64 --output-len 128 --request-rate 4 --num-prompts 80"

v4_serve() {  # v4_serve GRAPH_MODE
    local dir
    dir=$(preset_dir "$V4")
    serve_and_load "v4-serve-$1" "$dir" "--max-model-len 8192 --graph-mode $1" \
        "--input-len 1024 --output-len 128 --request-rate 4,inf --num-prompts 80" "$PREFIXED"
    v4_prefix_off "$1"
}

v4_prefix_off() {  # v4_prefix_off GRAPH_MODE: the shared-prefix workload, prefix caching off
    local dir
    dir=$(preset_dir "$V4")
    serve_and_load "v4-serve-$1-nocache" "$dir" \
        "--max-model-len 8192 --graph-mode $1 --no-enable-prefix-caching" "$PREFIXED"
}

group() {
    case $1 in
    v4-serve-auto) wheels && v4_serve auto ;;
    v4-serve-full) wheels && v4_serve full ;;
    v4-prefix-full)
        wheels && serve_and_load v4-prefix-full "$(preset_dir "$V4")" \
            "--max-model-len 8192 --graph-mode full" "$PREFIXED" && v4_prefix_off full
        ;;
    v4-generate)
        run v4-generate $AFD bench generate --model "$(preset_dir "$V4")" --load-format dummy \
            --max-model-len 8192 --batch-sizes 1,100 --input-len 1024 --output-len 128
        # One 1024-token prefill step: the yardstick of the served TTFT target.
        run v4-prefill-1024 python tools/profile_prefill.py --preset "$V4" --input-len 1024
        ;;
    v4-kernels)
        for ctx in 8192 65536; do
            run "v4-decode-$ctx" $AFD bench decode --preset "$V4" --random-weights \
                --graph-mode full_decode_only --context-len $ctx --batch-sizes 1,8,64
        done
        for b in 1 64; do
            run "v4-profile-b$b" python tools/profile_decode.py --preset "$V4" --batch $b \
                --context-len 8192 --graph-mode full_decode_only
        done
        run v4-prefill python tools/profile_prefill.py --preset "$V4" --input-len 8192 \
            --max-num-batched-tokens 8192
        ;;
    v4-prefill)
        local k=afdserve.kernels.triton
        run mhc-bench python tools/mhc_bench.py
        run v4-prefill python tools/profile_prefill.py --preset "$V4" --input-len 1024
        run v4-prefill-before python tools/profile_prefill.py --preset "$V4" --input-len 1024 \
            --set $k.mhc.ROWS_KERNEL_FROM=1000000000 --set $k.v4_attention.PREFILL_BLOCK_HEADS=16
        run v4-prefill-h32 python tools/profile_prefill.py --preset "$V4" --input-len 1024 \
            --set $k.v4_attention.PREFILL_BLOCK_HEADS=32
        ;;
    fp4)
        run fp4-prefill python tools/fp4_moe_bench.py --prefill \
            --batch-sizes 64,128,256,512,1024,8192
        run fp4-sweep python tools/fp4_moe_bench.py --sweep --batch-sizes 64
        ;;
    fp4-ws)
        run fp4-ws python tools/fp4_ws_bench.py --slots 6,36,200
        ;;
    qwen-serve)
        wheels && serve_and_load qwen-serve "$(preset_dir qwen3-30b-a3b)" "" \
            "--input-len 1024 --output-len 128 --request-rate 16,inf --num-prompts 200"
        run qwen-generate $AFD bench generate --model "$(preset_dir qwen3-30b-a3b)" \
            --load-format dummy --batch-sizes 200 --input-len 1024 --output-len 128
        ;;
    families)
        for p in ${FAMILIES:-deepseek-v3.2:4 glm-5:4 gpt-oss-120b:8 minimax-m2:8 qwen3.5-35b-a3b:8 \
            qwen3-next-80b-a3b:8 kimi-linear-48b-a3b:8}; do
            run "decode-${p//[:.]/-}" $AFD bench decode --preset "$p" --random-weights \
                --graph-mode full_decode_only --context-len 1024 --batch-sizes 1,64,256
        done
        ;;
    gpt-oss)
        run decode-gpt-oss $AFD bench decode --preset gpt-oss-120b:8 --random-weights \
            --graph-mode full_decode_only --context-len 1024 --batch-sizes 1,64,256
        run profile-gpt-oss-b64 python tools/profile_decode.py --preset gpt-oss-120b:8 --batch 64
        run profile-v32-b64 python tools/profile_decode.py --preset deepseek-v3.2:4 --batch 64
        ;;
    capacity)
        for p in qwen3-30b-a3b qwen3.5-35b-a3b:8 qwen3-next-80b-a3b:8 kimi-linear-48b-a3b:8; do
            run "capacity-${p//[:.]/-}" $AFD bench capacity --preset "$p" --load-format dummy \
                --context-len 32768 --topologies colocated
        done
        ;;
    spec)
        local q
        q=$(preset_dir qwen3-30b-a3b)
        for b in 1 8 64; do
            run "ngram-off-b$b" $AFD bench generate --model "$q" --load-format dummy \
                --workload repetitive --batch-sizes $b --input-len 512 --output-len 256
            run "ngram-on-b$b" $AFD bench generate --model "$q" --load-format dummy \
                --workload repetitive --batch-sizes $b --input-len 512 --output-len 256 \
                --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
        done
        for k in 0 1; do
            run "mtp-verify-k$k" $AFD bench decode --preset "$V4" --random-weights \
                --graph-mode full_decode_only --context-len 8192 --batch-sizes 1,64 \
                --num-speculative-tokens $k
        done
        ;;
    fp8)
        for q in "" "--quantization fp8"; do
            # shellcheck disable=SC2086
            run "qwen-decode${q:+-fp8}" $AFD bench decode --preset qwen3-30b-a3b --random-weights \
                --graph-mode full_decode_only --context-len 1024 --batch-sizes 1,8,64,256 $q
        done
        ;;
    v4-steps)
        wheels && serve_and_load v4-steps "$(preset_dir "$V4")" \
            "--max-model-len 8192 --graph-mode full --log-step-plan $OUT/v4-steps.jsonl" \
            "--input-len 1024 --output-len 128 --request-rate 4 --num-prompts 40" \
            "--input-len 1024 --output-len 128 --request-rate inf --num-prompts 80" "$PREFIXED"
        ;;
    next)
        # The 64-bit rows (twenty-second session): 4.3 GB of streams and of q, then all
        # of test_v4_fused.py (the mHC site and update at the shipped 64 x 64 columns).
        run v4-gpu-tests python -m pytest -q -p no:cacheprovider --tb=short \
            tests/gpu/test_v4_fused.py tests/gpu/test_v4_fused_model.py
        for c in 8192 65536; do
            for topology in colocated in-process; do
                run "v4-decode-$c-$topology" $AFD bench decode --preset "$V4" --random-weights \
                    --graph-mode full_decode_only --context-len "$c" --batch-sizes 1,8,64 \
                    --topology "$topology"
            done
        done
        run fp4-bench python tools/fp4_moe_bench.py --batch-sizes 1,8,64
        run v4-prefill python tools/profile_prefill.py --preset "$V4" --input-len 8192 \
            --max-num-batched-tokens 8192
        ;;
    gpu-tests)
        run gpu-tests python -m pytest -q -p no:cacheprovider -x tests/gpu/test_gated_deltanet_gpu.py \
            tests/gpu/test_deepseek_v4.py tests/gpu/test_v4_fused.py tests/gpu/test_v4_fused_model.py
        ;;
    *)
        echo "unknown group $1 (see the head of $0)" >&2
        return 2
        ;;
    esac
}

[ $# -gt 0 ] || {
    sed -n '2,/^set /{/^set /!p}' "$0"
    exit 2
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >"$OUT/device.txt" 2>&1
pack() {  # at most 8 files come back from a device call: past that, one archive travels
    [ "$(find "$OUT" -type f | wc -l)" -gt 8 ] || return 0
    tar -czf /tmp/gpu-figures.tgz -C "$OUT" . && find "$OUT" -type f ! -name index.log -delete &&
        mv /tmp/gpu-figures.tgz "$OUT/"
}
trap 'exit 143' TERM INT  # a `timeout` around this still packs what ran
trap pack EXIT
for g in "$@"; do
    group "$g"
done
