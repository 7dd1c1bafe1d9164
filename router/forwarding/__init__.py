"""Forwarding one request: admission, the attempt loop with retries, the upstream HTTP/1.1
client, and the Prometheus metrics each request records.

Imports ``routing`` (where to send it) and ``fleet`` (the backends); never ``http``.
"""
