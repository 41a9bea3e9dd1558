"""Compiling the native CPU kernels (``csrc/``) with the system C compiler: at install time (setup.py runs
:func:`build_all` into the package's ``prebuilt/``) and, where that did not happen, on first use into the
hydraspec home. A library's file name carries a hash of its sources and flags, so a prebuilt library is used
only while it matches the sources next to it. Imports nothing but the standard library (setup.py loads it
before torch exists).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
PREBUILT = Path(__file__).with_name("prebuilt")
SOURCES = {"avx512": "bf16_linear.c", "avx2": "avx2_linear.c"}
FLAGS = {"avx512": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-shared", "-fPIC"],
         "avx2": ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC"]}


def library_name(isa: str, csrc: Path = CSRC) -> str | None:
    """The file name of ``isa``'s library for the sources now in ``csrc`` (None: no such source)."""
    src = Path(csrc) / SOURCES[isa]
    if not src.exists():
        return None
    text = src.read_bytes() + b"".join(h.read_bytes() for h in sorted(Path(csrc).glob("*.h")))  # and the headers
    key = hashlib.sha256(text + " ".join(FLAGS[isa]).encode()).hexdigest()[:16]
    return f"{src.stem}-{key}.so"


def prebuilt_dir() -> Path:
    """Where install-time builds are looked for (HYDRASPEC_PREBUILT overrides, e.g. to hide them)."""
    return Path(os.environ.get("HYDRASPEC_PREBUILT") or PREBUILT)


def compile_library(isa: str, out_dir: Path, csrc: Path = CSRC) -> tuple[Path | None, str]:
    """Compile ``isa``'s library from the sources in ``csrc`` (another version's, for comparisons) into
    ``out_dir`` (kept if already there); returns (path or None, why not). OpenMP is used when the compiler
    has it (it splits rows over cores)."""
    name = library_name(isa, csrc)
    if name is None:
        return None, f"no source for {isa}"
    so = Path(out_dir) / name
    if so.exists():
        return so, ""
    cc = os.environ.get("CC", "cc")
    err = ""
    try:
        so.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
            tmp_so = Path(tmp) / name
            for extra in (["-fopenmp"], []):
                res = subprocess.run([cc, *FLAGS[isa], *extra, str(Path(csrc) / SOURCES[isa]), "-o", str(tmp_so)],
                                     capture_output=True, text=True)
                if res.returncode == 0:
                    os.replace(tmp_so, so)  # atomic: a half-written library is never loaded
                    return so, ""
                err = res.stderr.strip()[:200]
    except (OSError, subprocess.SubprocessError) as exc:
        err = str(exc)
    return None, err


def build_all(out_dir: Path, say=print) -> int:
    """Install time: compile every build into ``out_dir``; a failure (no compiler, an old one) is reported
    and skipped, never fatal. Returns how many were built."""
    built = 0
    for isa in SOURCES:
        so, err = compile_library(isa, out_dir)
        if so is not None:
            built += 1
            say(f"hydraspec: built the {isa} CPU kernel ({so.name})")
        else:
            say(f"hydraspec: no {isa} CPU kernel at install time ({err}); it is built on first use if a "
                "compiler appears, else torch runs everything")
    return built
