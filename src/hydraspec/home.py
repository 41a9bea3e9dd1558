"""Where hydraspec keeps what it downloads and builds, and the package versions its kept files are keyed by."""
from __future__ import annotations

import hashlib
import json
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = ["hydraspec_home", "installed_version", "keep_json", "kept_path"]


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


def kept_path(folder: str, what, prefix: str = "") -> Path:
    """Where a measurement that depends on ``what`` (any JSON-able list of the things it depends on) is kept in
    the home's ``folder``: a file named by a hash of ``what``."""
    key = hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:24]
    return hydraspec_home() / folder / f"{prefix}{key}.json"


def keep_json(path: Path, data) -> None:
    """Write ``data`` as JSON at ``path`` atomically (other processes read the whole file or none); a home that
    cannot be written is skipped: what was to be kept is measured again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError:
        pass
