"""Where hydraspec keeps what it downloads and builds, and the package versions its kept files are keyed by."""
from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = ["hydraspec_home", "installed_version"]


def hydraspec_home() -> Path:
    """``$HYDRASPEC_HOME`` if set, else ``~/.cache/hydraspec``."""
    env = os.environ.get("HYDRASPEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hydraspec"


def installed_version(package: str) -> str:
    """The installed version of ``package`` ("" when it is not installed as a distribution)."""
    try:
        return version(package)
    except PackageNotFoundError:
        return ""
