"""Memory a batch needs before anything is allocated: KV caches and verify logits, against what is free."""
from __future__ import annotations

import logging

import torch

from .cache import text_config
from .errors import HydraspecError

log = logging.getLogger("hydraspec.memory")

MEMORY_HEADROOM = 0.9  # a batch may use at most this share of the free memory for its KV caches


def kv_bytes_per_slot(model) -> int:
    """Bytes one cache slot (one token position of one row) takes over all layers: keys and values."""
    cfg = text_config(model)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype_size = torch.empty((), dtype=model.dtype).element_size()
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * dtype_size


def cache_bytes(model, rows: int, capacity: int) -> int:
    """rows x capacity x layers x 2 (K, V) x kv_heads x head_dim x dtype size."""
    return rows * capacity * kv_bytes_per_slot(model)


def available_memory(device) -> int | None:
    """Free bytes where the cache will live: the GPU's free memory, or the host's available memory."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        import psutil  # optional

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"




def check_memory(model, need: int, rows: int, memory_limit: int | None = None, logits: int = 0) -> None:
    """Refuse (HydraspecError) a batch whose KV cache + verify logits exceed 90% of the free memory."""
    free = memory_limit if memory_limit is not None else available_memory(model.device)
    if free is None:
        log.warning("cannot tell how much memory is free; not checking the %s KV cache", gib(need))
        return
    if need + logits > MEMORY_HEADROOM * free:
        raise HydraspecError(
            f"a batch of {rows} needs {gib(need)} of KV cache ({rows} rows x capacity x "
            f"{text_config(model).num_hidden_layers} layers x K/V x kv heads x head dim x dtype) and "
            f"{gib(logits)} of verify logits, more than {int(MEMORY_HEADROOM * 100)}% of the {gib(free)} "
            f"free on {model.device}; use a smaller --batch-size or --max-new-tokens")
