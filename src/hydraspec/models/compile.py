"""Step compilation: a loaded model's decoding steps and verify forwards run as compiled steps
(:func:`hydraspec.backend.compile_steps`), compiled once at load time on a scratch cache."""

from __future__ import annotations

import gc
import sys
import time
import warnings

import torch

from ..backend import compile_steps
from ..cache import new_cache
from ..cpu.kernels import release_free_memory
from ..verify import forward_nodes

__all__ = ["compile_models"]


def compile_models(*models, how: bool | str = True, hidden: bool = False) -> None:
    """Compile the decoding steps of each model given (None is skipped; ``how`` as ``load_model``'s
    ``compile``); ``hidden``: the first model's steps that also return the last hidden state (for draft
    heads) are compiled now too. The command line loads the target and the draft model first and compiles both after:
    loading a draft model that is re-quantised passes through a peak of its own, which should not come on
    top of the memory that compiling the target keeps (BENCHMARKS.md, peak memory)."""
    if how:
        for i, model in enumerate(models):
            if model is not None:
                _compile(model, quiet=how == "auto", hidden=hidden and i == 0)


def _compile(model, quiet: bool = False, hidden: bool = False) -> None:
    why = compile_steps(model)
    if why is not None:
        if not quiet:
            warnings.warn(f"hydraspec: decoding steps run uncompiled: {why}", stacklevel=4)
        return
    _compile_now(model, hidden)
    gc.collect()
    release_free_memory()  # what compiling freed goes back to the system


def _compile_now(model, hidden: bool = False) -> None:
    """Compile the model's two step graphs (one new token, several) now, on a scratch cache, so that the first
    answer does not pay for them; with ``hidden`` also the two that return the last hidden state."""
    print("hydraspec: compiling the decoding steps (once per process; a minute or two on two cores)",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with torch.inference_mode():  # the engine's inputs are inference tensors, and the graphs are specific to that
        cache = new_cache(model, 16)
        # a prefill (eager; with ``hidden`` it installs transformers' hooks that capture hidden states, which
        # installed inside a graph would break it), one token, two tokens
        steps = ((0, 5, hidden), (5, 6, False), (6, 8, False))
        if hidden:
            steps += ((8, 9, True), (9, 11, True))
        for start, stop, want in steps:
            ids = torch.arange(start, stop, device=model.device)
            forward_nodes(model, cache, ids, ids.clone(), None, 0, want_hidden=want)
    print(f"hydraspec: compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
