"""FasterDecoding Medusa-1 checkpoints: import into hydraspec heads, export from them.

Their layout: `medusa_lm_head.pt` (or `.safetensors`) holding, for head i, residual block j and L
blocks per head, `{i}.{j}.linear.weight`, `{i}.{j}.linear.bias` and the head's own vocabulary
projection `{i}.{L}.weight` (optionally under a `medusa_head.` prefix), plus a config.json with
`medusa_num_heads`, `medusa_num_layers` and `base_model_name_or_path`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import HydraspecError
from .modules import MedusaHeads


def _read_state(d: Path) -> dict:
    for name in ("medusa_lm_head.safetensors", "medusa_lm_head.pt"):
        p = d / name
        if p.exists():
            state = load_file(str(p)) if p.suffix == ".safetensors" else torch.load(p, map_location="cpu",
                                                                                     weights_only=True)
            return {re.sub(r"^(medusa_head\.)", "", k): v for k, v in state.items()}
    raise HydraspecError(f"no medusa_lm_head.safetensors or medusa_lm_head.pt in '{d}'")


def import_medusa(directory, model) -> tuple[MedusaHeads, dict]:
    d = Path(directory)
    state = _read_state(d)
    cfg_path = d / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    heads_idx = sorted({int(k.split(".")[0]) for k in state})
    n_heads = cfg.get("medusa_num_heads", len(heads_idx))
    n_layers = cfg.get("medusa_num_layers", len({k.split(".")[1] for k in state if k.endswith("linear.weight")}))
    proj = state.get(f"0.{n_layers}.weight")
    if proj is None:
        raise HydraspecError(f"'{d}' does not look like a Medusa checkpoint: no '0.{n_layers}.weight'")
    vocab, hidden = proj.shape
    mcfg = model.config.get_text_config(decoder=True)
    if (hidden, vocab) != (mcfg.hidden_size, mcfg.vocab_size):
        raise HydraspecError(f"Medusa heads in '{d}' have hidden {hidden}, vocab {vocab}; this model has hidden "
                             f"{mcfg.hidden_size}, vocab {mcfg.vocab_size}")
    heads = MedusaHeads(hidden, vocab, num_heads=n_heads, num_layers=n_layers, lm_head=None, own_projection=True)
    ours = {}
    for i in range(n_heads):
        for j in range(n_layers):
            ours[f"blocks.{i}.{j}.linear.weight"] = state[f"{i}.{j}.linear.weight"]
            ours[f"blocks.{i}.{j}.linear.bias"] = state[f"{i}.{j}.linear.bias"]
        ours[f"proj.{i}.weight"] = state[f"{i}.{n_layers}.weight"]
    heads.load_state_dict(ours)
    heads.to(device=model.device, dtype=model.dtype).eval()
    return heads, {"base_model": cfg.get("base_model_name_or_path"), "kind": "medusa"}


def export_medusa(heads: MedusaHeads, directory, base_model: str) -> Path:
    """Write heads in FasterDecoding's layout (a shared projection is written out as each head's own)."""
    if heads.kind != "medusa":
        raise HydraspecError(f"only Medusa heads have a FasterDecoding layout, not {heads.kind}")
    if heads.subset is not None or heads.prefix is not None:
        raise HydraspecError("heads with a draft vocabulary or a prefix layer have no FasterDecoding layout "
                             "(it needs full-vocabulary projections); train them without --draft-vocab to export")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    L = heads.num_layers
    state = {}
    for i in range(heads.num_heads):
        for j in range(L):
            lin = heads.blocks[i][j].linear
            state[f"{i}.{j}.linear.weight"] = lin.weight.detach().cpu().contiguous()
            state[f"{i}.{j}.linear.bias"] = lin.bias.detach().cpu().contiguous()
        proj = heads.proj[i] if heads.own_projection else heads._shared[0]
        state[f"{i}.{L}.weight"] = proj.weight.detach().cpu().clone().contiguous()
    save_file(state, str(out / "medusa_lm_head.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "medusa_num_heads": heads.num_heads, "medusa_num_layers": L, "base_model_name_or_path": base_model,
        "hidden_size": heads.hidden, "vocab_size": heads.vocab}, indent=1))
    return out
