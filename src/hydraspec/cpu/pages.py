"""Model weights in 2 MB pages (Linux transparent huge pages).

A decoding step streams every weight from memory once, and with 4 KB pages the CPU's hardware prefetchers
stop at each page boundary and every page costs a TLB walk. :func:`to_huge_pages` copies a model's large
tensors (registered parameters and buffers, and tensors kept as plain attributes such as a packed weight) into
one anonymous private mapping marked ``MADV_HUGEPAGE``, packed end to end so that only the mapping's last
page can be partly empty. Views keep their offsets and strides, tensors that shared storage still share it,
and a tied parameter stays one object, so the model computes exactly what it computed before (tested); only
where its bytes live changes. Nothing is done where the kernel never gives huge pages (``never`` in
``/sys/kernel/mm/transparent_hugepage/enabled``), off Linux, or with ``HYDRASPEC_HUGEPAGES=0``.
"""
from __future__ import annotations

import mmap
import os

import torch
from torch import nn

from .kernels import release_free_memory

__all__ = ["HUGE_PAGE", "available", "to_huge_pages"]

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each storage's first byte: a cache line (and any element size)
_RELEASE_EVERY = 64 << 20
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def available() -> bool:
    """Whether marking memory for huge pages can take effect here."""
    if os.environ.get("HYDRASPEC_HUGEPAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_MODE) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _tensors(module: nn.Module):
    """(holder dict, key, tensor) for every CPU tensor a module of ``module`` holds: parameters, buffers and
    plain tensor attributes."""
    for m in module.modules():
        for d in (m._parameters, m._buffers, m.__dict__):
            for k, t in list(d.items()):
                # plain tensors and parameters only: a tensor subclass may keep its bytes elsewhere
                if (type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu" and t.layout == torch.strided
                        and not t.is_quantized):
                    yield d, k, t


def to_huge_pages(module: nn.Module, min_bytes: int = 1 << 20) -> int:
    """Move every storage of at least ``min_bytes`` that ``module`` holds into one huge-page mapping; returns
    the bytes moved (0 where :func:`available` is false). Each old storage is let go as soon as it is copied,
    and freed memory goes back to the system every 64 MB and at the end, so memory grows by about that much
    while this runs."""
    if not available():
        return 0
    groups: dict[int, list] = {}  # storage address -> [storage, [(holder, key, tensor)]]
    for d, k, t in _tensors(module):
        st = t.untyped_storage()
        if st.nbytes() >= min_bytes:
            groups.setdefault(st.data_ptr(), [st, []])[1].append((d, k, t))
    if not groups:
        return 0
    sizes = {a: -(-g[0].nbytes() // _ALIGN) * _ALIGN for a, g in groups.items()}
    total = sum(sizes.values())
    span = -(-total // HUGE_PAGE) * HUGE_PAGE  # whole huge pages (an untouched tail costs nothing)
    region = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive while any view does
    storage = arena.untyped_storage()
    at = (-arena.data_ptr()) % HUGE_PAGE  # the first byte on a huge-page boundary
    freed = 0
    moved: dict[int, torch.Tensor] = {}  # id(old tensor) -> its new tensor (a tied parameter stays one object)
    for addr in list(groups):
        old, users = groups.pop(addr)
        n = old.nbytes()
        arena[at:at + n].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
        for d, k, t in users:
            if id(t) not in moved:
                esize = t.element_size()
                new = torch.empty(0, dtype=t.dtype).set_(storage, at // esize + t.storage_offset(), t.size(), t.stride())
                if isinstance(t, nn.Parameter):
                    new = nn.Parameter(new, requires_grad=t.requires_grad)
                moved[id(t)] = new
            d[k] = moved[id(t)]
        del old, users, t
        at += sizes[addr]
        freed += n
        if freed >= _RELEASE_EVERY:  # freed heap pages back to the system as we go, not at the end
            release_free_memory()
            freed = 0
    release_free_memory()
    return total
