"""EAGLE-3 heads in the `speculators` checkpoint format (config.json + model.safetensors), the format
vLLM and SGLang load EAGLE-3 drafters from (https://github.com/vllm-project/speculators).

The layout is speculators' ``Eagle3DraftModel``: ``fc`` over the joined layers named by
``eagle_aux_hidden_state_layer_ids`` (transformers' hidden-state numbering, as hydraspec.features), one
``layers.0`` Llama decoder layer whose q, k and v read [input_layernorm(embedding), hidden_norm(state)],
``norm``, ``lm_head`` over the draft vocabulary with ``d2t`` (draft index -> target token offset) and
``t2d`` (target tokens in the draft vocabulary), and the target's ``embed_tokens``. Written without the
speculators package (it pins older transformers); the test loads the export back with its own classes.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import HydraspecError

FORMAT_VERSION = "0.9.0"  # the speculators release whose reader the round-trip test checks


def export_speculators(heads, model, directory, base_model: str, dtype: torch.dtype = torch.bfloat16,
                       draft_tokens: int | None = None) -> Path:
    """Write EAGLE-3 ``heads`` (trained for ``model``) to ``directory``; ``draft_tokens``: the greedy chain's
    length the config proposes (default the heads' draft depth)."""
    if heads.kind != "eagle3":
        raise HydraspecError(f"the speculators format holds EAGLE-3 heads (train-heads --kind eagle3), not "
                             f"{heads.kind} heads")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in _state(heads, model).items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(_config(heads, model, base_model, dtype, draft_tokens), indent=1))
    return out


def _state(heads, model) -> dict:
    state = {"fc.weight": heads.fc.weight, "layers.0.hidden_norm.weight": heads.hidden_norm.weight,
             "norm.weight": heads.norm.weight, "lm_head.weight": heads.projection_weight(),
             "embed_tokens.weight": model.get_input_embeddings().weight}
    state.update({f"layers.0.{k}": v for k, v in heads.layers[0].state_dict().items()})
    state = {k: v.detach().float().cpu() for k, v in state.items()}
    if heads.subset is not None:  # speculators' maps: target id = draft index + d2t[index]
        sub = heads.subset.cpu()
        state["d2t"] = sub - torch.arange(sub.numel())
        state["t2d"] = torch.zeros(heads.vocab, dtype=torch.bool)
        state["t2d"][sub] = True
    return state


def _config(heads, model, base_model: str, dtype: torch.dtype, draft_tokens: int | None) -> dict:
    layer = {**heads.config.to_diff_dict(), "model_type": "llama"}
    layer.pop("_attn_implementation", None)
    arch = list(getattr(model.config, "architectures", None) or [type(model).__name__])
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": FORMAT_VERSION, "dtype": str(dtype).removeprefix("torch."),
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": draft_tokens or heads.num_heads,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": base_model, "architectures": arch}},
        "transformer_layer_config": layer, "draft_vocab_size": heads.out_vocab, "norm_before_residual": False,
        "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": list(heads.feature_layers),
        "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False}
