"""The prefetch distance chosen by timing the machine's own model (hydraspec.cpu.prefetch)."""
import pytest
import torch

from hydraspec.cpu import kernels, prefetch
from hydraspec.cpu.gguf import GGUFLinear
from hydraspec.cpu.gguf_blocks import decode

from test_gguf import random_tensor


def test_a_distance_replaces_the_prior_only_when_clearly_faster():
    times = {1024: {1: 1.00, 6: 2.00}, 4096: {1: 0.99, 6: 1.98}, 8192: {1: 1.02, 6: 1.60}}
    assert prefetch.best(times, 1024) == 8192  # 0.91 of the prior on average
    times[8192] = {1: 1.00, 6: 1.97}
    assert prefetch.best(times, 1024) == 1024  # 1 % is within noise: the prior stays
    assert prefetch.best(times, 4096) == 4096


def _model(n: int = 3) -> torch.nn.Module:
    return torch.nn.Sequential(*[GGUFLinear(decode("Q4_K", random_tensor("Q4_K", 256, 512, seed=i), 256, 512))
                                 for i in range(n)])


def test_the_choice_is_timed_once_per_machine_and_kept(tmp_path, monkeypatch):
    """The first model large enough is timed at every candidate; the choice is set in the kernels and kept in
    the home, so the next load reads it without timing; outputs do not change."""
    lib = kernels.native_lib()
    if lib is None or not hasattr(lib, "hs_prefetch_ahead"):
        pytest.skip("no native kernel with a prefetch distance on this CPU")
    monkeypatch.setenv("HYDRASPEC_HOME", str(tmp_path))
    monkeypatch.delenv("HYDRASPEC_PREFETCH_BYTES", raising=False)
    model, x = _model(), torch.randn(3, 512).bfloat16()
    with torch.no_grad():
        before = model[0](x)
    monkeypatch.setattr(prefetch, "last_level_cache_bytes", lambda: 10 ** 12)
    assert prefetch.choose(model) is None and not prefetch.stored_path().exists()  # fits in the cache: not timed
    monkeypatch.setattr(prefetch, "last_level_cache_bytes", lambda: 1)
    timed = []
    real = prefetch.time_distances
    monkeypatch.setattr(prefetch, "time_distances", lambda *a: timed.append(1) or real(*a))
    try:
        chosen = prefetch.choose(model)
        assert chosen in set(prefetch.CANDIDATES) | {kernels.prefetch_bytes()} and timed == [1]
        assert kernels.prefetch_now(lib) == chosen and prefetch.read_choice(prefetch.stored_path()) == chosen
        with torch.no_grad():
            assert torch.equal(model[0](x), before)
        assert prefetch.choose(_model(1)) == chosen and timed == [1]  # read back, not timed again
        monkeypatch.setenv("HYDRASPEC_PREFETCH_BYTES", "2048")
        assert prefetch.choose(model) is None  # an override is left alone
    finally:
        kernels.set_prefetch(lib)


def test_a_damaged_choice_is_timed_again(tmp_path):
    path = tmp_path / "p.json"
    for text in ("", "{", '{"prefetch_bytes": "4k"}', '{"prefetch_bytes": -1}', "[]"):
        path.write_text(text)
        assert prefetch.read_choice(path) is None
    prefetch.write_choice(path, 4096)
    assert prefetch.read_choice(path) == 4096
