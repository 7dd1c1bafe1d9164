"""The GPU tier (``pytest -m e2e_gpu``): real SGLang replicas; skipped where no GPU is."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "e2e_gpu: end-to-end tests against real SGLang replicas on a GPU (deploy/local/run_sglang_gpu.sh)"
    )
