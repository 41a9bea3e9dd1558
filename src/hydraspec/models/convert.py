"""GGUF to Hugging Face: a GGUF file dequantized into a Hugging Face directory (model, tokenizer, generation
config and the ``hydraspec.json`` marker), or only its config and tokenizer when the weights stay in the file
(``quant="gguf"``); conversions of a user's ``.gguf`` files are cached per path, file version and dtype."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import transformers
from gguf import GGUFReader

from ..errors import HydraspecError
from ..home import hydraspec_home
from .common import MARKER_FORMAT, MARKER_NAME, has_gguf_magic, is_complete, locked, resolve_dtype, say

__all__ = ["convert_gguf", "gguf_cache_dir", "convert_local_gguf", "as_id_list"]

# End-of-turn markers that, when a GGUF's chat template uses them and the vocabulary has them, are
# added to the generation config's eos ids of an arbitrary converted .gguf file.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def _gguf_chat_template(gguf_file: Path) -> str | None:
    """The ``tokenizer.chat_template`` string stored in a GGUF's metadata, if any."""
    try:
        reader = GGUFReader(str(gguf_file))
        fld = reader.fields.get("tokenizer.chat_template")
        if fld is None:
            return None
        value = fld.contents()
        return value if isinstance(value, str) and value else None
    except Exception:  # metadata is best effort only
        return None


def as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _token_id(tokenizer, token: str) -> int | None:
    vocab = tokenizer.get_vocab()
    return vocab.get(token)


def _fix_generation_config(model, tokenizer, eos_tokens: tuple[str, ...] | None) -> None:
    """Make ``generation_config.eos_token_id`` list every end token; fill bos/pad when missing.

    ``eos_tokens=None`` (an arbitrary .gguf file) picks the end-of-turn tokens its chat template uses.
    """
    gen = model.generation_config
    eos = as_id_list(gen.eos_token_id) or as_id_list(getattr(model.config, "eos_token_id", None))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.insert(0, tokenizer.eos_token_id)
    if eos_tokens is None:
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        eos_tokens = tuple(t for t in _END_OF_TURN_TOKENS if t in template)
    for token in eos_tokens:
        tid = _token_id(tokenizer, token)
        if tid is not None and tid not in eos:
            eos.append(tid)
    if eos:
        gen.eos_token_id = eos[0] if len(eos) == 1 else eos
    if gen.bos_token_id is None and tokenizer.bos_token_id is not None:
        gen.bos_token_id = tokenizer.bos_token_id
    if gen.pad_token_id is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else None)
        if pad is not None:
            gen.pad_token_id = pad


def _strip_quantizer(model) -> None:
    """A dequantized GGUF model is a plain dense model: drop what would stop ``save_pretrained``."""
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            with contextlib.suppress(AttributeError):
                delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        with contextlib.suppress(AttributeError):
            del model.config.quantization_config
    with contextlib.suppress(AttributeError):
        model.is_quantized = False


def _transformers_convert(gguf_file: Path, dtype: str, out_dir: Path, eos_tokens: tuple[str, ...] | None) -> dict:
    """Dequantize ``gguf_file`` with transformers and save model + tokenizer to ``out_dir``.

    Returns facts for the marker. Split out so tests can replace it.
    """
    torch_dtype = resolve_dtype(dtype)
    gguf_file = gguf_file.resolve()
    parent, fname = str(gguf_file.parent), gguf_file.name
    model = transformers.AutoModelForCausalLM.from_pretrained(
        parent,
        gguf_file=fname,
        dtype=torch_dtype,
        quantization_config=transformers.GgufConfig(gguf_file=str(gguf_file), dequantize=True),
    )
    tokenizer = _gguf_tokenizer(gguf_file)
    _fix_generation_config(model, tokenizer, eos_tokens)
    _strip_quantizer(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return _facts(model, tokenizer)


def _gguf_tokenizer(gguf_file: Path):
    """The tokenizer transformers builds from a GGUF's metadata, with the file's chat template."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    if not tokenizer.chat_template:
        template = _gguf_chat_template(gguf_file)
        if template:
            tokenizer.chat_template = template
    return tokenizer


def _facts(model, tokenizer) -> dict:
    """What a conversion's marker records of the model (anything with .config and .generation_config)."""
    return {
        "model_type": model.config.model_type,
        "vocab_size": int(model.config.vocab_size),
        "tokenizer_size": len(tokenizer),
        "eos_token_id": model.generation_config.eos_token_id,
        "has_chat_template": bool(tokenizer.chat_template),
    }


def _meta_convert(gguf_file: Path, out_dir: Path, eos_tokens: tuple[str, ...] | None) -> dict:
    """Save only the config, generation config and tokenizer of ``gguf_file`` to ``out_dir``: the weights
    stay in the GGUF, read at their own precision on loading (``quant="gguf"``)."""
    gguf_file = gguf_file.resolve()
    config = transformers.AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer = _gguf_tokenizer(gguf_file)
    holder = SimpleNamespace(config=config, generation_config=transformers.GenerationConfig.from_model_config(config))
    _fix_generation_config(holder, tokenizer, eos_tokens)
    config.save_pretrained(out_dir)
    holder.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return _facts(holder, tokenizer)


def check_form(dtype: str) -> None:
    """A conversion's form: a dtype of :data:`DTYPES` (dequantized weights) or "gguf" (no weights)."""
    if dtype != "gguf":
        resolve_dtype(dtype)


def _convert_into(tmp: Path, gguf_file: Path, dtype: str, source: dict | None,
                  eos_tokens: tuple[str, ...] | None, start: float) -> None:
    """The conversion itself, into the temporary directory ``tmp``, its marker written last."""
    if dtype == "gguf":
        facts = _meta_convert(gguf_file, tmp, eos_tokens)
    else:
        facts = _transformers_convert(gguf_file, dtype, tmp, eos_tokens)
    marker = {
        "format": MARKER_FORMAT,
        "dtype": dtype,
        "source": dict(source or {}),
        "gguf_file": str(gguf_file.resolve()),
        "gguf_size": gguf_file.stat().st_size,
        "transformers_version": transformers.__version__,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "convert_seconds": round(time.perf_counter() - start, 1),
        **facts,
    }
    (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")


def convert_gguf(
    gguf_file: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str = "bfloat16",
    *,
    source: dict | None = None,
    eos_tokens: tuple[str, ...] | None = None,
    progress: bool = True,
) -> Path:
    """Convert a GGUF file into a Hugging Face directory ``out_dir`` (dequantized to ``dtype``).

    Does nothing when ``out_dir`` is already a complete conversion. The work happens in a sibling
    temporary directory that gets its ``hydraspec.json`` marker last and is then renamed into place.
    """
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    check_form(dtype)
    if is_complete(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with locked(out_dir.parent / f".{out_dir.name}.lock"):
        if is_complete(out_dir):  # someone else finished it while we waited
            return out_dir
        if out_dir.exists():  # left over from an interrupted run
            shutil.rmtree(out_dir)
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        say(progress, f"converting {gguf_file.name} to {dtype} (one time) -> {out_dir}")
        start = time.perf_counter()
        try:
            _convert_into(tmp, gguf_file, dtype, source, eos_tokens, start)
            os.replace(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        say(progress, f"converted in {time.perf_counter() - start:.1f}s")
    return out_dir


def gguf_cache_dir(gguf_file: str | os.PathLike, dtype: str) -> Path:
    """Cache directory for the conversion of a user's ``.gguf`` file.

    The name carries a hash of the absolute path and a hash of (size, mtime), so a changed file
    converts again (and the stale conversion of the same path is removed then).
    """
    p = Path(gguf_file).expanduser().resolve()
    st = p.stat()
    path_key = hashlib.sha256(str(p).encode()).hexdigest()[:10]
    file_key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", p.stem)[:60] or "model"
    return hydraspec_home() / "converted" / f"{stem}-{path_key}-{file_key}-{dtype}"


def convert_local_gguf(gguf_file: Path, dtype: str, progress: bool) -> Path:
    """A user's ``.gguf`` file converted (once per file version and dtype) into its cache directory."""
    target = gguf_cache_dir(gguf_file, dtype)
    if is_complete(target):
        return target
    st = gguf_file.stat()
    if not has_gguf_magic(gguf_file):
        raise HydraspecError(f"cannot load model '{gguf_file}': not a GGUF file (bad magic)")
    source = {"kind": "gguf", "path": str(gguf_file.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    convert_gguf(gguf_file, target, dtype, source=source, eos_tokens=None, progress=progress)
    # drop conversions of earlier versions of the same file (same path key, other file key)
    stem_path_key = target.name.rsplit("-", 2)[0]
    for stale in target.parent.glob(f"{stem_path_key}-*-{dtype}"):
        if stale != target and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return target
