from .checkpoint import DEFAULT_TREE, base_fingerprint, build_heads, load_heads, save_heads
from .modules import KINDS, HydraHeads, MedusaHeads

__all__ = ["MedusaHeads", "HydraHeads", "KINDS", "build_heads", "save_heads", "load_heads", "base_fingerprint", "DEFAULT_TREE"]
