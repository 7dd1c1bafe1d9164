"""Routing: what a request is to the router, the routing engine (tokens, the prefix index,
the conversation ledger, load), the policies, exact KV-event indexes and the peer exchange.

Imports ``fleet``, ``engines``, the base modules and ``tokenizer_index``; no I/O in policies.
"""
