"""Decoding loops run from a frame with room on CPython's frame stack.

CPython 3.11+ keeps the frames of a thread on a stack of chunks (16 KiB at first), allocated when a call does not
fit the current chunk and freed when that call returns. A loop whose every step descends past a chunk's end thus
maps and unmaps a chunk on each such call: hundreds of ``mmap``/``munmap`` pairs a decoding step, each unmap a
TLB shoot-down that stops the other core's compute thread. Whether it happens depends only on how deep the loop
sits (the server's loop started through ``main`` was caught, the same loop called from a script was not;
BENCHMARKS.md, "The frame-stack trap"). :func:`call_with_room` calls the loop from a frame so large that CPython
gives it a chunk of its own with ``ROOM_BYTES`` to spare above it, where every step's frames fit.
"""
from __future__ import annotations

import types

ROOM_BYTES = 64 * 1024  # room above the big frame; a decoding step's frames fit in one 16 KiB chunk
# stack slots of the big frame: CPython doubles a new chunk from 16 KiB until it holds the frame plus 1,000
# words, so a frame a little under ROOM_BYTES gets a chunk of 2 x ROOM_BYTES with over ROOM_BYTES free
FRAME_WORDS = ROOM_BYTES // 8 - 1000 + 64


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


_roomy = types.FunctionType(_call.__code__.replace(co_stacksize=FRAME_WORDS), globals(), "call_with_room")


def call_with_room(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, called from a frame that starts a frame-stack chunk of its own with room above it for
    everything ``fn`` calls (the result and any exception are ``fn``'s)."""
    return _roomy(fn, args, kwargs)
