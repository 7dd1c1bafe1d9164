"""Fault-injection suite: sim-engine subprocesses behind kvroute, faults injected under steady load."""
