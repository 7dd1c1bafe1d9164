# shellcheck shell=bash
# Shared shell functions of run_cpu.sh and run_gpu.sh: start vLLM replicas and kvroute,
# wait until they answer /health, and stop all of them on exit or Ctrl-C.
# Sourced, not executed. Each started process leads its own process group, so stopping it
# also stops the engine-core and worker processes vLLM forks.

KVROUTE_PIDS=()
KVROUTE_NAMES=()

log() { echo "[kvroute-local] $*" >&2; }

# start NAME LOGFILE ENV... -- COMMAND...: run COMMAND in the background, in a new session.
start() {
    local name="$1" logfile="$2"
    shift 2
    local envs=()
    while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    env "${envs[@]}" setsid "$@" >"$logfile" 2>&1 &
    KVROUTE_PIDS+=("$!")
    KVROUTE_NAMES+=("$name")
    log "started $name (pid $!), log: $logfile"
}

# stop_all: SIGINT every process group (vLLM shuts down cleanly on it), SIGKILL stragglers.
stop_all() {
    trap - EXIT INT TERM
    local pid deadline
    for pid in "${KVROUTE_PIDS[@]}"; do kill -INT -- "-$pid" 2>/dev/null || true; done
    deadline=$((SECONDS + ${KVROUTE_STOP_TIMEOUT:-20}))
    for pid in "${KVROUTE_PIDS[@]}"; do
        while kill -0 -- "-$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
    [ "${#KVROUTE_PIDS[@]}" -eq 0 ] || log "stopped ${KVROUTE_NAMES[*]}"
    KVROUTE_PIDS=()
}

# wait_healthy NAME URL PID LOGFILE TIMEOUT_S: poll URL/health until it answers 200.
wait_healthy() {
    local name="$1" url="$2" pid="$3" logfile="$4" timeout="$5"
    local deadline=$((SECONDS + timeout))
    until curl -sf -o /dev/null --max-time 2 "$url/health"; do
        if ! kill -0 "$pid" 2>/dev/null; then
            log "$name exited before becoming healthy; last lines of $logfile:"
            tail -n 30 "$logfile" >&2
            return 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "$name not healthy after ${timeout}s; last lines of $logfile:"
            tail -n 30 "$logfile" >&2
            return 1
        fi
        sleep 1
    done
    log "$name healthy at $url"
}

# kv_events_config EVENTS_PORT REPLAY_PORT: vLLM's --kv-events-config JSON. A "*" endpoint
# makes vLLM bind, so any number of routers can subscribe (and later ones can replay).
kv_events_config() {
    printf '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:%s","replay_endpoint":"tcp://*:%s","topic":"%s"}' \
        "$1" "$2" "${KVROUTE_KV_EVENTS_TOPIC:-kv-events}"
}

# write_router_config FILE HOST TOKENIZER BLOCK_SIZE: kvroute's YAML config for the replicas
# on HOST at ports PORTS, with their KV event and replay endpoints (EVENT_PORTS, REPLAY_PORTS,
# arrays set by the caller; RANKS, each replica's data-parallel ranks, default 1). TOKENIZER
# and BLOCK_SIZE may be empty (kvroute's defaults).
# Precise mode is on; KVROUTE_* environment variables (e.g. KVROUTE_KV_EVENTS=false,
# KVROUTE_POLICY=round_robin, KVROUTE_PORT) override the file, as for any kvroute setting.
write_router_config() {
    local file="$1" host="$2" tokenizer="$3" block_size="$4" i
    {
        echo "host: 127.0.0.1"
        echo "port: 8000"
        echo "policy: cache_aware"
        echo "kv_events: true"
        [ -z "$tokenizer" ] || echo "tokenizer: $tokenizer"
        [ -z "$block_size" ] || echo "block_size: $block_size"
        echo "data_parallel_size: ${RANKS:-1}"
        echo "backends:"
        for i in "${!PORTS[@]}"; do
            echo "  - url: http://$host:${PORTS[$i]}"
            echo "    kv_events_endpoint: tcp://$host:${EVENT_PORTS[$i]}"
            echo "    kv_events_replay_endpoint: tcp://$host:${REPLAY_PORTS[$i]}"
        done
    } >"$file"
}

# start_router LOG_DIR: kvroute serve with LOG_DIR/kvroute.yaml; waits until it is healthy.
start_router() {
    local log_dir="$1" port="${KVROUTE_PORT:-8000}"
    start kvroute "$log_dir/kvroute.log" -- "${KVROUTE_BIN:-kvroute}" serve --config "$log_dir/kvroute.yaml"
    wait_healthy kvroute "http://127.0.0.1:$port" "${KVROUTE_PIDS[-1]}" "$log_dir/kvroute.log" 120
    log "ready: kvroute http://127.0.0.1:$port (metrics at /metrics, config $log_dir/kvroute.yaml)"
}

# wait_any: block until one started process exits, then report which and return non-zero.
wait_any() {
    local i
    wait -n "${KVROUTE_PIDS[@]}" || true
    for i in "${!KVROUTE_PIDS[@]}"; do
        if ! kill -0 "${KVROUTE_PIDS[$i]}" 2>/dev/null; then
            log "${KVROUTE_NAMES[$i]} exited; stopping the rest"
        fi
    done
    return 1
}
