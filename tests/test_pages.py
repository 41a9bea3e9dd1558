"""Weights moved into huge pages (hydraspec.cpu.pages) compute exactly what they computed before, keep their
ties and views, and land in memory the kernel may back with 2 MB pages."""
import pytest
import torch
from torch import nn

from hydraspec.cpu import pages
from tiny import make_model

needs_thp = pytest.mark.skipif(not pages.available(), reason="transparent huge pages are off on this machine")


def _thp_eligible(addr: int) -> bool:
    """Whether the mapping holding ``addr`` may get huge pages (its THPeligible line in /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "THPeligible:":
                return line.split()[1] == "1"
    return False


@needs_thp
def test_moved_model_computes_the_same_and_keeps_ties_and_views():
    model = make_model("llama", layers=2)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as many checkpoints are
    holder = model.model.layers[0].mlp
    holder.plain = holder.up_proj.weight.detach()[4:20]  # a plain attribute viewing a parameter's storage
    ids = torch.tensor([[3, 17, 5, 9, 42, 8]])
    with torch.inference_mode():
        before = model(ids).logits
    old_ptr = model.model.embed_tokens.weight.data_ptr()
    moved = pages.to_huge_pages(model, min_bytes=0)
    assert moved >= sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.model.embed_tokens.weight
    assert isinstance(emb, nn.Parameter) and model.lm_head.weight is emb and emb.data_ptr() != old_ptr
    up = holder.up_proj.weight
    assert holder.plain.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
    assert torch.equal(holder.plain, up.detach()[4:20])
    for p in model.parameters():
        assert _thp_eligible(p.data_ptr())
    with torch.inference_mode():
        after = model(ids).logits
    assert torch.equal(before, after)


@needs_thp
def test_small_tensors_stay_and_switch_off(monkeypatch):
    model = make_model("llama", layers=1)
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert pages.to_huge_pages(model) == 0  # every tensor is under the 1 MB default
    monkeypatch.setenv("HYDRASPEC_HUGEPAGES", "0")
    assert not pages.available() and pages.to_huge_pages(model, min_bytes=0) == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs
