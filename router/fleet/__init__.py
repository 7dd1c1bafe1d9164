"""The fleet: backends and their state, health probes, the circuit breaker, discovery
(static file, Kubernetes) and the engines' own statistics.

Imports ``engines`` and the base modules only.
"""
