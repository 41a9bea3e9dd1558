"""Where hydraspec keeps what it downloads and builds."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["hydraspec_home"]


def hydraspec_home() -> Path:
    """``$HYDRASPEC_HOME`` if set, else ``~/.cache/hydraspec``."""
    env = os.environ.get("HYDRASPEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hydraspec"
