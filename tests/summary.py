"""Result lines that tests attach to their reports, for pytest's terminal summary.

Under pytest-xdist (CI) a test runs in a worker process, and only its reports reach the
controller, which prints the summary; and the controller loads only the root conftest. So
a test's lines travel in its report's ``user_properties`` (the e2e tier's
``tests/e2e/conftest.py`` puts them there) and the root conftest prints them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: The key of a report's ``user_properties`` whose values are result lines.
SUMMARY_PROPERTY = "kvroute-summary"


def summary_lines(stats: Mapping[str, Iterable[Any]]) -> list[str]:
    """The result lines of every report in a terminal reporter's ``stats``, in order."""
    return [
        value
        for reports in stats.values()
        for report in reports
        for key, value in getattr(report, "user_properties", ())
        if key == SUMMARY_PROPERTY
    ]
