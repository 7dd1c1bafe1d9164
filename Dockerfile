# kvroute: cache-aware load-balancing reverse proxy for vLLM / SGLang fleets.
#
#   docker build -t kvroute .
#   docker run --rm -p 8000:8000 \
#       -e KVROUTE_BACKENDS=http://10.0.0.11:8000,http://10.0.0.12:8000 \
#       -e KVROUTE_POLICY=cache_aware kvroute
#
# Every setting of `kvroute serve` is also a KVROUTE_<NAME> environment variable; flags
# after the image name replace CMD (e.g. `kvroute serve --policy round_robin`).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVROUTE_HOST=0.0.0.0 \
    KVROUTE_PORT=8000 \
    NUMBA_CACHE_DIR=/var/cache/kvroute/numba

WORKDIR /opt/kvroute
# Sources only (see .dockerignore); the default tokenizer ships inside tokenizer_index.
COPY pyproject.toml README.md ./
COPY router/ router/
COPY tokenizer_index/ tokenizer_index/
COPY benchmarks/ benchmarks/
# The prefix index's compiled loops are compiled here, once, into a cache the router's user
# can read and write (a read-only root file system compiles them at start instead). The k8s
# extra is the Kubernetes client that --discovery k8s (the Helm chart's default) needs.
RUN pip install --no-cache-dir ./[k8s] \
    && useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin kvroute \
    && python -c "import kvroute.tokenizer_index.kernels" \
    && chown -R 10001:10001 /var/cache/kvroute

USER 10001:10001
EXPOSE 8000

# The router's own /health endpoint (stdlib only: the slim image has no curl).
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KVROUTE_PORT', '8000'), timeout=2)"]

ENTRYPOINT ["kvroute"]
CMD ["serve"]
