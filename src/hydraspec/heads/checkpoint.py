"""Heads checkpoints: safetensors weights + config.json (kind, sizes, base model, default tree)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..backend import W4_GROUPS, fuse_ops, int8_per_row, prepack, quantize_drafting
from ..errors import HydraspecError
from ..features import set_feature_layers
from .eagle import EagleHeads
from .eagle3 import Eagle3Heads
from .modules import KINDS, Heads
from .prefix import PrefixLayer

KINDS = {**KINDS, "eagle": EagleHeads, "eagle3": Eagle3Heads}

FORMAT = "hydraspec-heads"
DEFAULT_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


def default_tree(num_heads: int) -> list[list[int]]:
    return [p for p in DEFAULT_TREE if len(p) <= num_heads]


def build_heads(kind: str, model, num_heads: int = 4, num_layers: int = 1, own_projection: bool = False,
                prefix_layer: bool = False, vocab_subset=None, **extra) -> Heads:
    """Fresh heads for `model`. prefix_layer adds Hydra++'s extra decoder layer (identity when fresh);
    vocab_subset (token ids) restricts the heads' projection to a draft vocabulary; ``extra``: what a kind
    takes beyond these (EAGLE: intermediate_size; EAGLE-3: feature_layers). The model's forwards then hand
    out the features these heads read (hydraspec.features)."""
    if kind not in KINDS:
        raise HydraspecError(f"unknown head kind '{kind}'; known: {', '.join(KINDS)}")
    heads = KINDS[kind].for_model(model, num_heads=num_heads, num_layers=num_layers, own_projection=own_projection,
                                  vocab_subset=vocab_subset, **extra)
    if prefix_layer:
        try:
            heads.prefix = PrefixLayer(model)
        except ValueError as e:
            raise HydraspecError(f"cannot add a prefix-attention layer: {e}") from None
    set_feature_layers(model, getattr(heads, "feature_layers", None))
    return heads.to(model.device)


def heads_state(heads: Heads) -> dict[str, torch.Tensor]:
    """The tensors of a heads checkpoint (heads.safetensors)."""
    return {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}


def heads_config(heads: Heads, base_model: str, tree: list[list[int]] | None = None, **extra) -> dict:
    """The config.json of a heads checkpoint."""
    return {"format": FORMAT, "kind": heads.kind, "num_heads": heads.num_heads, "num_layers": heads.num_layers,
            "hidden_size": heads.hidden, "vocab_size": heads.vocab, "own_projection": heads.own_projection,
            "prefix_layer": heads.prefix is not None,
            "draft_vocab": heads.out_vocab if heads.subset is not None else None, "base_model": base_model,
            "default_tree": tree or default_tree(heads.num_heads), **heads.extra_config(), **extra}


def save_heads(heads: Heads, directory, base_model: str, tree: list[list[int]] | None = None, **extra) -> Path:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(heads_state(heads), str(out / "heads.safetensors"))
    (out / "config.json").write_text(json.dumps(heads_config(heads, base_model, tree, **extra), indent=1))
    return out


FINGERPRINT_IDS, FINGERPRINT_DIRS, SAME_WEIGHTS = 16, 4, 0.97


@torch.inference_mode()
def base_fingerprint(model) -> list[float]:
    """The base model's weights in 128 numbers: the input embeddings of 16 token ids spread over the
    vocabulary, and the last hidden states of one forward over those ids, each projected on 4 fixed random
    directions. Any copy of the same weights gives nearly the same numbers whatever its dtype or file (bf16,
    float32, the GGUF's own 4-6 bits: rounding averages out in the projections); other weights (another
    model, or a base whose layers were tuned) give different ones."""
    emb = model.get_input_embeddings()
    vocab, dim = emb.num_embeddings, emb.embedding_dim
    ids = torch.linspace(1, vocab - 1, FINGERPRINT_IDS).long().to(model.device)[None]
    rows = emb(ids)[0].float().cpu()  # [16, dim]
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0].float().cpu()
    dirs = torch.randn(dim, FINGERPRINT_DIRS, generator=torch.Generator().manual_seed(0))
    return [round(float(v), 6) for v in torch.cat([(rows @ dirs).flatten(), (hidden @ dirs).flatten()])]


def same_weights(a: list[float], b: list[float]) -> float:
    """How alike two fingerprints are: the lower cosine similarity of their two halves (embeddings, hidden
    states); 1.0 is the same weights up to rounding."""
    x, y = torch.tensor(a), torch.tensor(b)
    if x.shape != y.shape:
        return 0.0
    half = x.numel() // 2
    cos = torch.nn.functional.cosine_similarity
    return min(float(cos(x[:half], y[:half], dim=0)), float(cos(x[half:], y[half:], dim=0)))


def read_features(directories, model) -> None:
    """Make ``model``'s forwards hand out the features that EAGLE-3 heads among ``directories`` (one, or a
    list) read, before anything is compiled (a step compiled for other features is traced again)."""
    for d in directories if isinstance(directories, (list, tuple)) else [directories]:
        try:
            layers = json.loads((Path(d) / "config.json").read_text()).get("feature_layers")
        except (OSError, json.JSONDecodeError):
            continue  # load_heads says what is wrong with the directory
        if layers:
            set_feature_layers(model, layers)


def read_heads_config(directory) -> dict:
    """The config.json of the heads checkpoint in ``directory``; a one-line error where there is none."""
    d = Path(directory)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HydraspecError(f"cannot read heads config in '{d}': {e}") from None
    if cfg.get("format") != FORMAT:
        raise HydraspecError(f"'{d}' is not a hydraspec heads checkpoint")
    return cfg


def load_heads(directory, model, base_model: str | None = None, drafting: bool = False) -> tuple[Heads, dict]:
    """Load heads for `model`; refuses heads trained for a model of another shape or other weights (by the
    checkpoint's ``base_fingerprint``: any path to the same weights is accepted), or, for checkpoints
    without a fingerprint, of another name. ``drafting``: the heads only draft, so on a bf16 CPU model their
    layers run on the 4-bit draft-model kernels (backend.quantize_drafting; the answers never change)."""
    d = Path(directory)
    cfg = read_heads_config(d)
    mcfg = model.config.get_text_config(decoder=True)
    if (cfg["hidden_size"], cfg["vocab_size"]) != (mcfg.hidden_size, mcfg.vocab_size):
        raise HydraspecError(
            f"heads in '{d}' were trained for '{cfg.get('base_model')}' (hidden {cfg['hidden_size']}, vocab "
            f"{cfg['vocab_size']}); this model has hidden {mcfg.hidden_size}, vocab {mcfg.vocab_size}")
    if cfg.get("base_fingerprint"):
        sim = same_weights(cfg["base_fingerprint"], base_fingerprint(model))
        if sim < SAME_WEIGHTS:
            raise HydraspecError(f"heads in '{d}' were trained for other weights ('{cfg.get('base_model')}'; "
                                 f"this model matches its fingerprint at {sim:.2f}, need "
                                 f"{SAME_WEIGHTS})")
    # a jointly tuned base (Medusa-2) is close to its original: such heads also go by the base's name
    if (cfg.get("joint") or not cfg.get("base_fingerprint")) and base_model and cfg.get("base_model") and \
            _norm(cfg["base_model"]) != _norm(base_model):
        raise HydraspecError(f"heads in '{d}' were trained for '{cfg['base_model']}', not '{base_model}'")
    heads = saved_heads(d, model, cfg)
    heads.to(device=model.device, dtype=model.dtype).eval()
    if model.device.type == "cpu":  # the CPU kernels of the base serve the heads' few-row matmuls too
        if drafting:
            drafting_kernels(heads)
        else:
            prepack(heads)
    return heads, cfg


def drafting_kernels(heads: Heads) -> Heads:
    """Heads that only draft on the CPU kernels: on a bf16 model their layers as w4a8 (the draft models'
    kernels: backend.quantize_drafting), the rest packed as the base's matmuls are, norms, rotary embedding
    and gated MLP on the fused ops (backend.fuse_ops: the same results). Returns them."""
    quantize_drafting(heads)
    prepack(heads)
    fuse_ops(heads)
    return heads


FRESH_DRAFT_VOCAB = 8192  # fresh heads of a larger vocabulary draft from its first ids


def fresh_heads(kind: str, model, eos: set[int] | None = None) -> Heads:
    """Untrained float32 heads of ``kind`` for ``model``: 4 heads of one layer; for a larger vocabulary, a
    draft vocabulary of the first FRESH_DRAFT_VOCAB ids and ``eos`` (no answers yet to count tokens in)."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    subset = None
    if vocab > FRESH_DRAFT_VOCAB:
        subset = sorted(set(range(FRESH_DRAFT_VOCAB)) | {i for i in (eos or ()) if 0 <= i < vocab})
    return build_heads(kind, model, num_heads=4, num_layers=1, vocab_subset=subset).float()


def ensure_heads(directory, model, kind: str, base_model: str, eos: set[int] | None = None) -> Path:
    """``directory`` holding heads for ``model``: fresh ones of ``kind`` saved there when it has none yet
    (the start of `serve --learn`; a DIRECTORY.old left by a replacement cut off half-way is taken back)."""
    d = Path(directory)
    old = d.with_name(d.name + ".old")
    if not d.exists() and (old / "config.json").exists():  # a replacement cut off between its two renames
        old.rename(d)
    if not (d / "config.json").exists():
        save_heads(fresh_heads(kind, model, eos), d, base_model=base_model,
                   base_fingerprint=base_fingerprint(model), trained_on=0)
    return d


def saved_heads(directory, model, cfg: dict | None = None) -> Heads:
    """The heads saved in ``directory`` (``cfg``: its config.json, read here when None) built for ``model`` with
    their weights as stored (float32 as training writes them), without load_heads' checks, casts and packing."""
    d = Path(directory)
    cfg = cfg if cfg is not None else read_heads_config(d)
    state = _dequantize(load_file(str(d / "heads.safetensors")))
    heads = build_heads(cfg["kind"], model, cfg["num_heads"], cfg["num_layers"], cfg["own_projection"],
                        prefix_layer=bool(cfg.get("prefix_layer")), vocab_subset=state.get("subset"),
                        **{k: cfg[k] for k in ("intermediate_size", "feature_layers") if cfg.get(k)})
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise HydraspecError(f"heads checkpoint '{d}' does not match its config (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
    return heads


def _norm(name: str) -> str:
    return Path(str(name)).name.lower().removesuffix(".gguf")


INT8_SCALE = ".int8_scale"  # a weight stored as int8 codes has its per-row scale under NAME + this
INT4_SCALE = ".int4_scale"  # a weight stored as 4-bit codes has its group scales under NAME + this
INT4_GROUPS = (*W4_GROUPS, 16)  # inputs per 4-bit scale: the first that divides a matrix's inputs (the
# draft kernels' groups first, so loading keeps the codes)


def copy_heads(src, dst, dtype: str = "bfloat16") -> Path:
    """Copy a heads checkpoint with its float weights cast to `dtype` (bf16 halves the size; the heads
    are cast to the model's dtype when loaded anyway), or with ``"int8"`` its matrices as int8 codes and one
    fp32 scale per row (absmax / 127; vectors in bf16), a quarter of the size, or with ``"int4"`` as 4-bit
    codes (two a byte) and one fp16 scale per row and group of inputs (INT4_GROUPS; absmax / 7 of the bf16
    weights, as the w4a8 kernels that heads draft on quantise them, so loading keeps their codes), an eighth of
    the size. Heads only draft, so this can change acceptance, never the output. Used to ship the offline
    models' heads."""
    s, d = Path(src), Path(dst)
    d.mkdir(parents=True, exist_ok=True)
    state = load_file(str(s / "heads.safetensors"))
    out = {}
    for k, v in state.items():
        group = next((g for g in INT4_GROUPS if v.ndim == 2 and v.shape[1] % g == 0), None)
        if not v.is_floating_point():
            out[k] = v
        elif dtype == "int8" and v.ndim == 2:
            out[k], out[k + INT8_SCALE] = int8_per_row(v)
        elif dtype == "int4" and group is not None:
            out[k], out[k + INT4_SCALE] = _int4_groups(v, group)
        else:
            out[k] = v.to(torch.bfloat16 if dtype in ("int8", "int4") else getattr(torch, dtype))
    save_file({k: v.contiguous() for k, v in out.items()}, str(d / "heads.safetensors"))
    shutil.copy(s / "config.json", d / "config.json")
    return d


def _int4_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> codes [out, in / 2] uint8 (code + 8, even inputs in the low nibble), scales [out, in / group]."""
    g = w.to(torch.bfloat16).float().view(w.shape[0], -1, group)
    scale = (g.abs().amax(-1) / 7.0).clamp_min(1e-12).half()
    q = (torch.round(g / scale.float()[..., None]).clamp_(-7, 7) + 8).to(torch.uint8).view(w.shape[0], -1, 2)
    return q[..., 0] | (q[..., 1] << 4), scale


def _dequantize(state: dict) -> dict:
    """Int8 and 4-bit weights written by :func:`copy_heads` back to float32."""
    for key in [k for k in state if k.endswith(INT8_SCALE)]:
        name = key[: -len(INT8_SCALE)]
        state[name] = state[name].float() * state.pop(key)[:, None]
    for key in [k for k in state if k.endswith(INT4_SCALE)]:
        name, scale = key[: -len(INT4_SCALE)], state.pop(key).float()
        packed = state[name]
        q = torch.stack([packed & 15, packed >> 4], dim=-1).view(*scale.shape, -1).float() - 8
        state[name] = (q * scale[..., None]).view(packed.shape[0], -1)
    return state
