"""The ``kvroute`` command: ``serve``, ``sim-engine``, ``demo``, ``bench``.

Each subcommand's module owns its own argument parser; this file only dispatches, and
imports lazily so that ``kvroute serve`` does not load the benchmark code.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvroute.router.serve", "run the cache-aware reverse proxy"),
    "sim-engine": ("kvroute.benchmarks.sim_engine.cli", "run a simulated vLLM or SGLang replica"),
    "demo": ("kvroute.benchmarks.demo", "two sim engines, a router, round_robin vs cache_aware"),
    "bench": ("kvroute.benchmarks.bench", "replay workloads and traces against a fleet per policy"),
}


def _usage() -> str:
    lines = ["usage: kvroute {" + ",".join(SUBCOMMANDS) + "} [options]", "", "commands:"]
    lines += [f"  {name:<12} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    lines += ["", "Run 'kvroute COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvroute`` console script."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from kvroute.router import __version__

        print(f"kvroute {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command not in SUBCOMMANDS:
        print(f"kvroute: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
