"""kvroute serve's logging: --decision-log writes its lines whatever --log-level says."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import logging
from kvroute.router.config import Settings
from kvroute.router.routing.decisions import DECISION_LOGGER
from kvroute.router.serve import configure_logging
configure_logging(Settings(log_level="warning", decision_log={decision_log}))
logging.getLogger(DECISION_LOGGER).info('{{"backend": "http://b0"}}')
logging.getLogger("kvroute.router").info("an info line")
logging.getLogger("kvroute.router").warning("a warning line")
"""


def _stderr(decision_log: bool) -> str:
    child = subprocess.run(
        [sys.executable, "-c", CHILD.format(decision_log=decision_log)], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr
    return child.stderr


def test_the_decision_log_is_written_at_a_quieter_log_level() -> None:
    text = _stderr(True)
    assert '{"backend": "http://b0"}' in text and "a warning line" in text
    assert "an info line" not in text  # the rest still at the level asked for


def test_without_the_flag_decisions_follow_the_log_level() -> None:
    assert '{"backend": "http://b0"}' not in _stderr(False)
