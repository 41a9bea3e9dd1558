"""Compiled decode steps: the stock model's forward under ``torch.compile`` (TorchInductor) with the native
kernels as PyTorch operators inside the graph.

A decode step of a 4-bit model on a CPU spends a fair share of its time in Python between the ~200 native
calls (module calls, views, residual adds, the cache write, transformers' own bookkeeping; docs/cpu-kernels.md,
"Compiled decode steps"). Inductor
traces the stock transformers classes once and replaces that Python with one generated wrapper
(PyTorch 2, Ansel et al., ASPLOS 2024). Dynamo cannot trace a ctypes call, so the native kernels are also
registered as operators (``csrc/hs_torch_ops.cpp``, namespace ``hydraspec``) that call the same C
functions with the same arguments, and the rotary embedding's cos/sin are computed by the stock module
behind an opaque operator. Every number is therefore computed by the same code as in an eager step:
a compiled step returns the same logits bit for bit (tested); only the Python between the kernels goes.

Forwards of at most :data:`MAX_ROWS` new tokens are compiled: one-token steps (plain decoding, a draft
model's chain) and verify forwards (a chain or tree of drafts, a draft model catching up on accepted
tokens). Longer forwards and any forward from an empty cache (prefill) stay eager. A call without a mask
gets the causal one it implies, so two graphs per model are compiled, one for a single row and one for
several (once per process; docs/cpu-kernels.md has the compile times). Forwards that ask for the hidden states (for draft
heads that read the target's last one) run a second pair of graphs that return the last hidden state
with the logits.
The operator library is compiled with the system C++ compiler against the installed torch on first use
(into the hydraspec home); without a compiler, torch's headers or the native kernels, nothing is compiled
and every step runs eagerly as before.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config  # noqa: F401  (torch._inductor.config below)
import torch.fx.experimental._config as fx_config
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..cache import cache_kwargs
from ..features import features
from . import kernels, ops
from .gguf import GGUFLinear
from .quantized import W4A8Linear

__all__ = ["available", "compile_steps", "causal_mask"]


@lru_cache(maxsize=1)
def available() -> str | None:
    """Load the operator library (building it on first use) and hand it the kernels; None when ready, else
    why not."""
    gguf_lib, fused = kernels.int8_dot_lib(), kernels.fused_lib()
    if gguf_lib is None or fused is None or not hasattr(gguf_lib, "hs_gguf_apply"):
        return "the native CPU kernels are not available here"
    addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
    return ops.load([addr(gguf_lib.hs_gguf_apply), addr(gguf_lib.hs_gguf_rows), addr(fused.hs_attention),
                     addr(fused.hs_rmsnorm), addr(fused.hs_rope_bf16), addr(fused.hs_silu_mul_bf16),
                     addr(gguf_lib.hs_linear_w4a8)])


# the keywords of hydraspec's own model calls (hydraspec.verify); other callers (transformers' generate) run eagerly
_STEP_KEYWORDS = {"input_ids", "position_ids", "attention_mask", "cache", "past_key_values", "use_cache",
                  "output_hidden_states", "logits_to_keep"}
# the hydraspec modules whose forwards the compiled steps can trace (the others call ctypes only)
_TRACEABLE = {"GGUFLinear", "GGUFEmbedding", "W4A8Linear", "DraftVocabHead", "FusedRMSNorm", "FusedGatedMLP",
              "SharedInput", "Projection"}


#: the most new tokens a compiled forward takes (a verify tree's size at most); longer forwards run eagerly
MAX_ROWS = 16


def _step(kwargs) -> bool:
    ids = kwargs.get("input_ids")
    return (ids is not None and ids.dim() == 2 and ids.shape[0] == 1 and 1 <= ids.shape[1] <= MAX_ROWS
            and isinstance(kwargs.get("logits_to_keep", 0), int) and kwargs.keys() <= _STEP_KEYWORDS)


def causal_mask(n: int, past: int, dtype=torch.bfloat16, device=None) -> torch.Tensor:
    """The additive [1, 1, n, past + n] mask that lets new token i see the cache and new tokens 0..i: what a
    model builds for itself when given none (passed in by the steps so that masked and unmasked calls share one
    graph; a drafting head's layer reads its new pairs under it)."""
    mask = torch.zeros(n, past + n, dtype=dtype, device=device)
    if n > 1:
        later = torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)
        mask[:, past:].masked_fill_(later, torch.finfo(dtype).min)
    return mask[None, None]


def _run(compiled, past: int, cache: dict, input_ids, position_ids=None, attention_mask=None, use_cache=True,
         output_hidden_states=False, logits_to_keep=0):
    """Call the compiled forward with its arguments in one form, so that every caller shares two graphs (one
    row, several rows): the implied causal mask and positions filled in, logits for every row (the last
    kept afterwards where only they were asked for: a row's logits do not depend on the others).
    ``compiled``: the pair (plain forward, forward returning (logits, last hidden state)); with
    output_hidden_states the second runs and ``hidden_states`` holds the features only (hydraspec.features). ``cache``:
    the KV cache under the keyword the model takes it by (hydraspec.cache.cache_kwargs)."""
    n = input_ids.shape[1]
    if attention_mask is None:
        attention_mask = causal_mask(n, past)
    if position_ids is None:
        position_ids = torch.arange(past, past + n)[None]
    duck = fx_config.use_duck_shape  # off: sizes that happen to be equal (rows, heads) must not become one
    fx_config.use_duck_shape = False
    floats = dynamo_config.specialize_float  # on: a float scalar made symbolic restarts the whole trace
    dynamo_config.specialize_float = True
    kw = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, **cache,
              use_cache=use_cache)
    try:
        if output_hidden_states:
            logits, hidden = compiled[1](**kw)
            out = CausalLMOutputWithPast(logits=logits, **cache_kwargs(CausalLMOutputWithPast, *cache.values()),
                                         hidden_states=(hidden,))
        else:
            out = compiled[0](**kw, output_hidden_states=False, logits_to_keep=0)
    finally:
        fx_config.use_duck_shape = duck
        dynamo_config.specialize_float = floats
    if 0 < logits_to_keep < n:
        out.logits = out.logits[:, -logits_to_keep:]
    return out


def _untraceable(model) -> str | None:
    for m in model.modules():
        cls = type(m)
        if cls.__module__.startswith("hydraspec.") and cls.__name__ not in _TRACEABLE:
            return cls.__name__
    return None


# the guards on a model kept in its compiled steps: those that compare a value of the model itself or its config
# (a config field, the feature layers the heads read); the others check its modules' structure, constants,
# weights and hooks
_VALUE_GUARDS = {"CONSTANT_MATCH", "EQUALS_MATCH"}


def module_values_only(entries) -> list[bool]:
    """torch.compile's guard filter for the compiled steps: a loaded model's modules and weights stay as they
    are (nothing in hydraspec adds a module, a weight or a hook to it), so the several thousand guards that
    check them on every call are left out (their cost: BENCHMARKS.md). Each model compiles its own steps (a
    test runs two models of one class side by side)."""
    return [not e.orig_guard.source.is_unspecialized_nn_module()
            or (e.guard_type in _VALUE_GUARDS and "._modules[" not in e.name) for e in entries]


def step_options() -> dict:
    """torch.compile's options for the steps: the guard filter above, and no size and stride assertions in the
    generated code on our operators' outputs; each where this torch has it (an older torch refuses options it
    does not know, and compiles the steps with every guard)."""
    inductor = torch._inductor.config
    options = {name: False for name in ("size_asserts", "alignment_asserts") if hasattr(inductor, name)}
    if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):  # the filters ship with the option
        options["guard_filter_fn"] = module_values_only
    return options


def compile_steps(model: torch.nn.Module) -> str | None:
    """Make ``model``'s forwards of up to :data:`MAX_ROWS` new tokens compiled steps (see the module
    docstring); returns None when done, else why not (the model is then left as it was). The first one-token
    and the first several-token forward each compile (a minute or so each on two cores)."""
    if getattr(model, "hs_compiled", False):
        return None
    why = available()
    if why is not None:
        return why
    if model.device.type != "cpu" or model.dtype != torch.bfloat16:
        return "compiled steps need a bf16 model on the CPU"
    if not any(isinstance(m, (GGUFLinear, W4A8Linear)) for m in model.modules()):
        return "compiled steps run models at a GGUF file's own precision (--quant gguf) or w4a8 drafts"
    bad = _untraceable(model)
    if bad is not None:
        return f"compiled steps cannot trace {bad} modules"
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "sliding_window", None) and "sliding_attention" in (getattr(cfg, "layer_types", None) or
                                                                        ["sliding_attention"]):
        return "compiled steps build a plain causal mask: models with sliding-window layers run eagerly"
    for m in model.modules():
        if isinstance(m, GGUFLinear):
            m.call_tensor()
        if type(m).__name__.endswith("RotaryEmbedding") and hasattr(m, "inv_freq") and not hasattr(m, "hs_eager_forward"):
            index = ops.register_rotary(m)
            eager = m.forward
            m.hs_eager_forward = eager

            def forward(x, position_ids, *rest, _index=index, _eager=eager):
                if ops.tracing() and not rest:
                    return torch.ops.hydraspec.rotary(x, position_ids, _index)
                return _eager(x, position_ids, *rest)
            m.forward = forward
    eager_forward = model.forward

    def with_hidden(**kw):  # only the features leave the graph (the other states are never kept)
        out = eager_forward(**kw, output_hidden_states=True, logits_to_keep=0)
        return out.logits, features(model, out.hidden_states)
    # each its own options: torch.compile pops the guard filter out of the dict it is given
    compiled = (torch.compile(eager_forward, dynamic=True, options=step_options()),
                torch.compile(with_hidden, dynamic=True, options=step_options()))
    key = next(iter(cache_kwargs(model, None)))  # the keyword the model's forward takes its cache by

    def forward(*args, **kwargs):
        if not args and _step(kwargs) and not torch.is_grad_enabled():
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            past = 0 if cache is None else cache.get_seq_length()
            if past:  # a step after a prompt (a forward from an empty cache is a prefill: eager)
                rest = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}
                return _run(compiled, past, {key: cache}, **rest)
        return eager_forward(*args, **kwargs)
    model.forward = forward
    model.hs_compiled = True
    model.hs_eager_forward = eager_forward
    return None


def eager_forward(model: torch.nn.Module):
    """The forward ``model`` had before :func:`compile_steps` (its forward itself when not compiled)."""
    return getattr(model, "hs_eager_forward", model.forward)

