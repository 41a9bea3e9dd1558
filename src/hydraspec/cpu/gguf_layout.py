"""What loading needs from a GGUF file's header: its architecture, where each tensor lies, and which
transformers parameter each tensor is. Read once per file and kept in the hydraspec home.

Parsing the header with ``gguf.GGUFReader`` builds every metadata field (the tokenizer's strings: 10-15 s on
two cores for a 49k-151k vocabulary), and transformers' ``get_gguf_hf_weights_map`` builds gguf's name table
once per module of the model (another 10-13 s); neither result changes while the file and the two libraries
stay the same. The index is keyed by the file (path, size, modification time) and the versions of
transformers and gguf; a changed file or library reads the header again.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from ..home import hydraspec_home, installed_version, keep_json

__all__ = ["Layout", "file_layout", "index_path"]

FORMAT = 1


@dataclass
class Layout:
    """``arch``: the file's architecture name; ``tensors``: per tensor (name, type, rows, cols, offset,
    bytes, numpy dtype, shape); ``mapping``: GGUF tensor name -> transformers parameter name."""

    arch: str
    tensors: list[tuple]
    mapping: dict[str, str]


def index_path(gguf_file) -> Path:
    """Where the index of ``gguf_file`` is kept (named by a hash of what it depends on)."""
    path = Path(gguf_file).resolve()
    st = path.stat()
    key = f"{FORMAT}|{path}|{st.st_size}|{st.st_mtime_ns}|{installed_version('transformers')}|{installed_version('gguf')}"
    return hydraspec_home() / "gguf-index" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def file_layout(gguf_file, model, processor_for: Callable[[str], object]) -> Layout:
    """The layout of ``gguf_file`` for ``model`` (built on the meta device): from the index where it is kept,
    else read from the header (``processor_for(arch)``: transformers' tensor processor) and kept."""
    where = index_path(gguf_file)
    try:
        data = json.loads(where.read_text())
        layout = Layout(data["arch"], [_tensor_from_json(t) for t in data["tensors"]], data["mapping"])
        if layout.tensors and max(t[4] + t[5] for t in layout.tensors) <= Path(gguf_file).stat().st_size:
            return layout
    except (OSError, ValueError, KeyError, TypeError):
        pass
    layout = _read(gguf_file, model, processor_for)
    _keep(where, layout)
    return layout


def _read(gguf_file, model, processor_for) -> Layout:
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map  # heavy

    reader = GGUFReader(str(gguf_file))
    arch = str(reader.fields["general.architecture"].contents())
    reader.fields.clear()  # the metadata (the tokenizer's strings) is large as parsed objects
    mapping = get_gguf_hf_weights_map(model, processor_for(arch))
    tensors = [(t.name, t.tensor_type, int(t.shape[1]) if len(t.shape) > 1 else 1, int(t.shape[0]),
                int(t.data_offset), int(t.n_bytes), t.data.dtype, tuple(int(x) for x in t.data.shape))
               for t in reader.tensors]
    return Layout(arch, tensors, mapping)


def _keep(where: Path, layout: Layout) -> None:
    """Write the index (atomically; a read-only home just means reading the header next time)."""
    data = {"arch": layout.arch, "mapping": layout.mapping,
            "tensors": [[n, q.name, r, c, o, b, np.dtype(d).str, list(s)] for n, q, r, c, o, b, d, s in layout.tensors]}
    keep_json(where, data)


def _tensor_from_json(t: list) -> tuple:
    name, qtype, rows, cols, offset, nbytes, dtype, shape = t
    return (name, GGMLQuantizationType[qtype], int(rows), int(cols), int(offset), int(nbytes), np.dtype(dtype),
            tuple(shape))
