#!/usr/bin/env bash
# Two SGLang replicas of a small instruct model sharing one GPU, and kvroute in front of them
# (engine: sglang; hits read from /generate meta_info and, with --enable-cache-report, from
# the OpenAI usage). Needs `pip install sglang` (GPU build; SGLang's CPU build targets Intel
# AMX) and kvroute on PATH; the model comes from the Hugging Face cache or hub. Ctrl-C stops
# everything.
#
#   deploy/local/run_sglang_gpu.sh
#   curl -s localhost:8000/generate -H 'content-type: application/json' \
#        -d '{"text":"The capital of France is","sampling_params":{"max_new_tokens":8}}'
#
# Settings (environment):
#   KVROUTE_GPU_MODEL          model (default Qwen/Qwen2.5-0.5B-Instruct; the router's tokenizer too)
#   KVROUTE_SGLANG_MEM         --mem-fraction-static per replica (default 0.35: two fit with headroom)
#   KVROUTE_SGLANG_PAGE_SIZE   --page-size (default 1, SGLang's own default: token-granular)
#   KVROUTE_SGLANG_PYTHON      Python with sglang installed (default: python3)
#   KVROUTE_SGLANG_PORTS       replica ports (default "8111 8112")
#   KVROUTE_SGLANG_EXTRA_ARGS  more sglang.launch_server flags
#   KVROUTE_RUN_ROUTER         0: start the replicas only (the e2e_gpu test starts its routers)
#   KVROUTE_PORT, KVROUTE_POLICY, KVROUTE_LOG_DIR, KVROUTE_START_TIMEOUT   as in run_gpu.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=deploy/local/lib.sh
source "$HERE/lib.sh"

MODEL="${KVROUTE_GPU_MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"
PYTHON="${KVROUTE_SGLANG_PYTHON:-python3}"
read -r -a PORTS <<<"${KVROUTE_SGLANG_PORTS:-8111 8112}"
read -r -a EXTRA <<<"${KVROUTE_SGLANG_EXTRA_ARGS:-}"
LOG_DIR="${KVROUTE_LOG_DIR:-$(mktemp -d -t kvroute-sglang.XXXXXX)}"
mkdir -p "$LOG_DIR"

"$PYTHON" -c "import sglang" 2>/dev/null || { log "sglang is not installed for $PYTHON (pip install sglang)"; exit 3; }

trap stop_all EXIT
trap 'exit 130' INT TERM

for port in "${PORTS[@]}"; do
    start "sglang-$port" "$LOG_DIR/sglang-$port.log" -- \
        "$PYTHON" -m sglang.launch_server --model-path "$MODEL" \
        --host 127.0.0.1 --port "$port" \
        --mem-fraction-static "${KVROUTE_SGLANG_MEM:-0.35}" \
        --page-size "${KVROUTE_SGLANG_PAGE_SIZE:-1}" \
        --enable-metrics --enable-cache-report \
        "${EXTRA[@]}"
    # Each replica sizes its KV pool from free GPU memory at start: one at a time.
    wait_healthy "sglang-$port" "http://127.0.0.1:$port" "${KVROUTE_PIDS[-1]}" \
        "$LOG_DIR/sglang-$port.log" "${KVROUTE_START_TIMEOUT:-900}"
done

if [ "${KVROUTE_RUN_ROUTER:-1}" = "1" ]; then
    {
        echo "host: 127.0.0.1"
        echo "port: ${KVROUTE_PORT:-8000}"
        echo "policy: ${KVROUTE_POLICY:-cache_aware}"
        echo "tokenizer: $MODEL"
        echo "backends:"
        for port in "${PORTS[@]}"; do
            echo "  - url: http://127.0.0.1:$port"
            echo "    engine: sglang"
        done
    } >"$LOG_DIR/kvroute.yaml"
    start_router "$LOG_DIR"
else
    log "ready: replicas $(printf 'http://127.0.0.1:%s ' "${PORTS[@]}")"
fi
log "logs in $LOG_DIR; Ctrl-C stops everything"
wait_any
