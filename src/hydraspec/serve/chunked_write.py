"""A safetensors file written a slice at a time, so that a server writes between its requests (``serve --learn``).

A write of several hundred megabytes in one go, in any thread, slows the requests around it on a two-core
machine (BENCHMARKS.md, "serve --learn on Qwen2.5-Coder-1.5B"). :class:`ChunkedWrite` writes the file in the
safetensors layout (an 8-byte header length, a JSON header, the tensors' bytes;
https://github.com/huggingface/safetensors) at most ``chunk`` bytes per :meth:`ChunkedWrite.step`, to
``PATH.tmp``, and renames it over ``PATH`` after the last slice, so ``PATH`` is always a whole file. The
tensors must not change until the write is done (the caller's duty). Read back with ``safetensors`` itself.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

CHUNK_BYTES = 32 << 20
DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


def layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytes:
    """The header: its length, then the JSON naming each tensor's dtype, shape and byte range, padded to 8."""
    head, at = {"__metadata__": metadata} if metadata else {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        head[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def raw_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class ChunkedWrite:
    """Writes ``tensors`` (and string ``metadata``) to ``path`` as a safetensors file, ``chunk`` bytes a step
    (None: CHUNK_BYTES); ``then()`` runs after the rename (the last step)."""

    def __init__(self, path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                 chunk: int | None = None, then=None):
        self.path, self.tmp = Path(path), Path(str(path) + ".tmp")
        self.parts = [memoryview(layout(tensors, metadata))] + [raw_bytes(t) for t in tensors.values()]
        self.chunk, self.then, self.file, self.done = chunk or CHUNK_BYTES, then, None, False

    def step(self) -> bool:
        """Write the next slice (at most ``chunk`` bytes); True once the file is in place."""
        if self.file is None:
            self.tmp.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.tmp, "wb")
        room = self.chunk
        while self.parts and room > 0:
            part = self.parts.pop(0)
            self.file.write(part[:room])
            if len(part) > room:
                self.parts.insert(0, part[room:])
            room -= len(part)
        return False if self.parts else self._finish()

    def _finish(self) -> bool:
        self.file.close()
        self.tmp.replace(self.path)
        if self.then is not None:
            self.then()
        self.done = True
        return True

    def run(self) -> None:
        """All the remaining slices now (at shutdown)."""
        while not self.done and not self.step():
            pass
