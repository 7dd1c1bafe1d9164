"""Workloads, trace replay, the simulated engine, policy comparisons and overhead."""
