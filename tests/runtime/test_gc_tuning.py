"""Objects a process loads at start-up leave the collector's generations."""

from __future__ import annotations

import gc

from cleave.runtime.gc_tuning import freeze_loaded_objects


class Module:  # stands in for what a model load leaves behind: tracked container objects
    def __init__(self, i: int) -> None:
        self.children = [i]


def test_objects_alive_at_the_call_are_no_longer_walked_by_collections() -> None:
    loaded = [Module(i) for i in range(1000)]
    assert all(gc.is_tracked(o) for o in loaded)
    try:
        frozen = freeze_loaded_objects()
        assert frozen >= len(loaded)
        walked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in walked for o in loaded)  # still alive, just not walked
        later = Module(-1)
        assert id(later) in {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()
