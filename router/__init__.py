"""kvroute's router: the asyncio reverse proxy (aiohttp on uvloop)."""

__version__ = "0.1.0"
