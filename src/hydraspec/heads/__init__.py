from .checkpoint import DEFAULT_TREE, KINDS, base_fingerprint, build_heads, drafting_kernels, ensure_heads, \
    heads_config, heads_state, load_heads, read_features, read_heads_config, save_heads, saved_heads
from .eagle import EagleHeads
from .modules import HydraHeads, MedusaHeads

__all__ = ["MedusaHeads", "HydraHeads", "EagleHeads", "KINDS", "build_heads", "save_heads", "load_heads", "read_features",
           "base_fingerprint", "DEFAULT_TREE", "ensure_heads", "saved_heads", "heads_config", "heads_state",
           "drafting_kernels", "read_heads_config"]
