"""hydraspec.frame_room: the decoding loops' frame stack. A call path that crosses the end of a CPython frame-stack
chunk maps a fresh chunk on every call (minor page faults); called with room, the same path maps none."""
from __future__ import annotations

import resource
import sys

import pytest

from hydraspec.frame_room import call_with_room

DEPTH, REPEATS = 300, 2000  # a call path of ~30 KiB of frames: past a 16 KiB chunk, within the room


def descend(n: int) -> int:
    a = b = c = n  # a frame of a few locals, as a decoding step's are
    return a - b + c - n if n == 0 else descend(n - 1) + 1


def repeat(times: int, depth: int) -> int:
    return sum(descend(depth) for _ in range(times))


def minor_faults(fn, *args) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn(*args)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_call_with_room_returns_and_raises_as_the_function_does():
    assert call_with_room(lambda a, b=1: a + b, 2, b=3) == 5
    assert call_with_room(repeat, 3, 10) == 30
    with pytest.raises(KeyError, match="x"):
        call_with_room({}.__getitem__, "x")


@pytest.mark.skipif(sys.version_info < (3, 11) or not sys.platform.startswith("linux"),
                    reason="frame-stack chunks are CPython 3.11+; page faults counted on Linux")
def test_a_deep_loop_maps_no_frame_chunks_with_room():
    minor_faults(repeat, 10, DEPTH)  # warm: the loop's own objects
    direct = minor_faults(repeat, REPEATS, DEPTH)
    roomy = minor_faults(call_with_room, repeat, REPEATS, DEPTH)
    assert direct >= REPEATS  # the trap is real here: a chunk mapped (and touched) on every repeat
    assert roomy < REPEATS // 20
