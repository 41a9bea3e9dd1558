"""The target's features that feature-reading drafters read, taken from a forward's hidden states.

Medusa, Hydra and EAGLE heads read the last hidden state (after the final norm: what the lm_head reads).
An EAGLE-3 head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test") reads the states of a low, a middle and a high layer, joined. Which layers a model's
forwards hand out is set once on the model (:func:`set_feature_layers`), so that every path that returns
hidden states (the verify forward, a prompt's read, the compiled steps, training's base forwards) returns
the same features, and the engine selects rows of them as it selects rows of the last state.
"""
from __future__ import annotations

import torch

from .errors import HydraspecError

__all__ = ["set_feature_layers", "feature_layers", "features"]

_ATTR = "hs_feature_layers"


def set_feature_layers(model, layers: list[int] | None) -> None:
    """Hidden-state indices (transformers' ``output_hidden_states`` numbering: 0 the embeddings, i the output
    of layer i - 1, the last the final norm's output) whose states are joined as the features, or None for
    the last state alone."""
    n = model.config.get_text_config(decoder=True).num_hidden_layers
    if layers is not None:
        layers = [int(i) for i in layers]
        if not layers or any(not 0 <= i <= n for i in layers):
            raise HydraspecError(f"feature layers must lie in [0, {n}] for this model, got {layers}")
        if layers == [n]:
            layers = None
    setattr(model, _ATTR, tuple(layers) if layers else None)


def feature_layers(model) -> tuple[int, ...] | None:
    return getattr(model, _ATTR, None)


def features(model, hidden_states) -> torch.Tensor:
    """The features from a forward's ``hidden_states`` (a tuple of [..., dim]): [..., width]. A compiled step
    (hydraspec.cpu.graph) hands out a 1-tuple: the features themselves."""
    layers = feature_layers(model)
    if layers is None or len(hidden_states) == 1:
        return hidden_states[-1]
    return torch.cat([hidden_states[i] for i in layers], dim=-1)
