"""What the model modules share: the dtype and device names, the marker that makes a converted directory
complete, an inter-process lock, and one-line messages."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

from ..errors import HydraspecError

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None

__all__ = ["DTYPES", "DEVICES", "GGUF_MAGIC", "MARKER_NAME", "MARKER_FORMAT", "resolve_dtype", "resolve_device",
           "is_complete", "read_marker", "has_gguf_magic", "locked", "say", "short_reason"]

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
GGUF_MAGIC = b"GGUF"
MARKER_NAME = "hydraspec.json"
MARKER_FORMAT = 1


def resolve_dtype(dtype: str):
    """Map a dtype name to its torch dtype; anything outside :data:`DTYPES` is a HydraspecError."""
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise HydraspecError(f"unsupported dtype '{dtype}'; choose one of: {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when available else ``cpu``; ``cuda`` without a GPU is a HydraspecError."""
    if not isinstance(device, str) or device not in DEVICES:
        raise HydraspecError(f"unsupported device '{device}'; choose one of: {', '.join(DEVICES)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise HydraspecError("device 'cuda' was requested but CUDA is not available (use --device cpu)")
    return device


def short_reason(exc: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message, shortened: fit for a one-line error."""
    text = str(exc).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if not line:
        line = type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def say(progress: bool, message: str) -> None:
    if progress:
        print(f"hydraspec: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """An exclusive inter-process lock (a no-op where ``fcntl`` is missing)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_complete(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` is a finished conversion (has a readable marker and a config)."""
    d = Path(directory)
    marker = d / MARKER_NAME
    if not marker.is_file() or not (d / "config.json").is_file():
        return False
    try:
        json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return True


def read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


def has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC
