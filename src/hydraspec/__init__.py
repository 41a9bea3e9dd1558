"""hydraspec: exact speculative decoding for Hugging Face causal LMs."""
from .accept import accept_greedy, accept_lossless, accept_typical
from .drafters import make_drafter
from .drafters.base import DecodeState, Drafter
from .errors import HydraspecError
from .generator import SpeculativeGenerator
from .results import GenerationResult, Stats
from .sampling import Sampling
from .tree import DraftTree

__version__ = "0.1.0"
__all__ = [
    "SpeculativeGenerator", "GenerationResult", "Stats", "Drafter", "DecodeState", "DraftTree",
    "Sampling", "HydraspecError", "make_drafter", "accept_greedy", "accept_lossless", "accept_typical",
]
