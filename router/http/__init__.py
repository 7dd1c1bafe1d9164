"""HTTP serving: the aiohttp application, its admin and OpenAPI endpoints, client auth.

The top room: it wires ``forwarding``, ``routing`` and ``fleet`` together and imports them;
nothing below imports it.
"""
