"""kvroute serve settles the cycle collector once the router is built."""

from __future__ import annotations

import gc

from kvroute.router.serve import GC_YOUNG_THRESHOLD, settle_garbage_collector


def test_startup_objects_are_frozen_and_young_collections_rare() -> None:
    threshold = gc.get_threshold()
    try:
        before = gc.get_freeze_count()
        settle_garbage_collector()
        assert gc.get_freeze_count() > before
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, threshold[1], threshold[2])
        # Cycles are still collected.
        cycle: list[object] = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
