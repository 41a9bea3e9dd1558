"""Recognising the stock transformers code that the fused ops stand in for: a class's or function's source
is, line for line, Llama's (transformers generates Qwen2's, Mistral's, Qwen3's, SmolLM's ... from it), so
the fused op computes exactly what it replaces."""
from __future__ import annotations

import inspect
from functools import lru_cache

__all__ = ["same_source"]


@lru_cache(maxsize=None)
def same_source(obj, reference) -> bool:
    """Whether ``obj`` (a function or method) has the same source text as ``reference``; False where either
    source cannot be read."""
    try:
        return inspect.getsource(obj).strip() == inspect.getsource(reference).strip()
    except (OSError, TypeError):
        return False
