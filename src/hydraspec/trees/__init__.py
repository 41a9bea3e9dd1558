"""Data-driven token trees (`hydraspec build-tree`): calibration ranks from the target's greedy
continuations (calibrate), nested trees grown from them (grow: Medusa's recipe, Cai et al. 2024, or a
replay of greedy decoding), timed on the device (measure) and chosen by measured tokens/s (build).
A tree only chooses what is drafted: decoding with any tree stays exact."""
from __future__ import annotations

from .build import DEFAULT_STOPS, build_tree, plot_tree, save_tree, stop_candidates

__all__ = ["DEFAULT_STOPS", "build_tree", "plot_tree", "save_tree", "stop_candidates"]
