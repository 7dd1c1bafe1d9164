#!/usr/bin/env bash
# Two vLLM replicas of a small instruct model sharing one GPU, and kvroute in front.
# Needs `pip install vllm` (GPU build) and kvroute on PATH; the model is fetched by vLLM
# from the Hugging Face hub unless it is already in the local cache. Ctrl-C stops everything.
#
#   deploy/local/run_gpu.sh
#   curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \
#        -d '{"model":"Qwen/Qwen2.5-0.5B-Instruct","messages":[{"role":"user","content":"hi"}]}'
#
# Settings (environment):
#   KVROUTE_GPU_MODEL         model (default Qwen/Qwen2.5-0.5B-Instruct; the router's tokenizer too)
#   KVROUTE_GPU_MEMORY        --gpu-memory-utilization per replica (default 0.4: two fit with headroom)
#   KVROUTE_VLLM_BIN          vLLM command (default: vllm)
#   KVROUTE_VLLM_HOST, KVROUTE_VLLM_PORTS, KVROUTE_KV_EVENTS_PORTS, KVROUTE_KV_REPLAY_PORTS,
#   KVROUTE_VLLM_EXTRA_ARGS, KVROUTE_RUN_ROUTER, KVROUTE_PORT, KVROUTE_POLICY, KVROUTE_LOG_DIR,
#   KVROUTE_START_TIMEOUT     as in run_cpu.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=deploy/local/lib.sh
source "$HERE/lib.sh"

MODEL="${KVROUTE_GPU_MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"
VLLM="${KVROUTE_VLLM_BIN:-vllm}"
HOST="${KVROUTE_VLLM_HOST:-127.0.0.1}"
read -r -a PORTS <<<"${KVROUTE_VLLM_PORTS:-8101 8102}"
read -r -a EVENT_PORTS <<<"${KVROUTE_KV_EVENTS_PORTS:-5557 5558}"
read -r -a REPLAY_PORTS <<<"${KVROUTE_KV_REPLAY_PORTS:-5567 5568}"
read -r -a EXTRA <<<"${KVROUTE_VLLM_EXTRA_ARGS:-}"
LOG_DIR="${KVROUTE_LOG_DIR:-$(mktemp -d -t kvroute-local.XXXXXX)}"
mkdir -p "$LOG_DIR"

trap stop_all EXIT
trap 'exit 130' INT TERM

BACKENDS=()
for i in "${!PORTS[@]}"; do
    port="${PORTS[$i]}"
    start "vllm-$port" "$LOG_DIR/vllm-$port.log" VLLM_SERVER_DEV_MODE=1 -- \
        "$VLLM" serve "$MODEL" \
        --host "$HOST" --port "$port" \
        --gpu-memory-utilization "${KVROUTE_GPU_MEMORY:-0.4}" \
        --enable-prefix-caching --enable-prompt-tokens-details \
        --kv-events-config "$(kv_events_config "${EVENT_PORTS[$i]}" "${REPLAY_PORTS[$i]}")" \
        "${EXTRA[@]}"
    BACKENDS+=("http://127.0.0.1:$port")
    # Both replicas profile free GPU memory at start: let the first claim its share first.
    wait_healthy "vllm-$port" "http://127.0.0.1:$port" "${KVROUTE_PIDS[-1]}" \
        "$LOG_DIR/vllm-$port.log" "${KVROUTE_START_TIMEOUT:-900}"
done

if [ "${KVROUTE_RUN_ROUTER:-1}" = "1" ]; then
    write_router_config "$LOG_DIR/kvroute.yaml" 127.0.0.1 "$MODEL" ""
    start_router "$LOG_DIR"
else
    log "ready: replicas ${BACKENDS[*]}"
fi
log "logs in $LOG_DIR; Ctrl-C stops everything"
wait_any
