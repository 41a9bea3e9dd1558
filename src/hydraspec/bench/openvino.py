"""OpenVINO GenAI as an optional benchmark baseline: `ov-ar`, `ov-draft` and `ov-pld`.

Each method runs an `openvino_genai.LLMPipeline` on the CPU in this process, on an int4 OpenVINO export of
the same model, with the bench's thread count (INFERENCE_NUM_THREADS), fed the same token ids, greedy or
plain sampling. Speculation uses OpenVINO GenAI's documented settings: `ov-draft` an
`openvino_genai.draft_model(...)` of --draft-model's export with num_assistant_tokens 5, `ov-pld` prompt
lookup (`prompt_lookup=True`) with num_assistant_tokens 5 and max_ngram_size 3. Its weights are its own
int4 compression, not the GGUF file's, so it is compared for speed only.

OpenVINO GenAI is not a dependency of hydraspec: `pip install openvino-genai` runs the methods. The exports
are made once with optimum-intel (`pip install optimum-intel`, best in a separate virtual environment with
`-c` pinning the installed torch, since it pins an older transformers and would otherwise pull a CUDA torch
through torchvision; uninstall torchvision there if its operators fail to load), from the Hugging Face
directory that `hydraspec models pull` converts, into $HYDRASPEC_OPENVINO_HOME (default
~/.cache/hydraspec/openvino)/NAME-int4:

    optimum-cli export openvino --model ~/.cache/hydraspec/models/NAME-bfloat16 \\
        --task text-generation-with-past --weight-format int4 ~/.cache/hydraspec/openvino/NAME-int4
"""
from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..errors import HydraspecError
from .methods import BenchContext, MethodSpec, Runner, TurnResult, register

NUM_ASSISTANT_TOKENS = 5  # OpenVINO GenAI's speculative decoding and prompt lookup samples
MAX_NGRAM_SIZE = 3  # its prompt lookup sample
FINISH_STOP = 1  # openvino_genai.GenerationFinishReason.STOP


def export_home() -> Path:
    env = os.environ.get("HYDRASPEC_OPENVINO_HOME")
    if env:
        return Path(env).expanduser()
    home = Path(os.environ.get("HYDRASPEC_HOME") or Path.home() / ".cache" / "hydraspec")
    return home / "openvino"


def export_dir(model: str) -> Path:
    """The int4 OpenVINO export of `model` (an offline name, a .gguf file or a directory: its base name),
    or a HydraspecError that gives the command making it."""
    name = Path(str(model).rstrip("/")).name
    name = name[: -len(".gguf")] if name.endswith(".gguf") else name
    path = export_home() / f"{name}-int4"
    if not (path / "openvino_model.xml").is_file():
        raise HydraspecError(
            f"no OpenVINO export of {model} at {path}; make it with optimum-intel: optimum-cli export openvino "
            f"--model <{name}'s Hugging Face directory, e.g. ~/.cache/hydraspec/models/{name}-bfloat16> --task "
            f"text-generation-with-past --weight-format int4 {path}")
    return path


def _genai():
    try:
        import openvino_genai  # optional
    except ImportError:
        raise HydraspecError("the ov-* methods need OpenVINO GenAI: pip install openvino-genai") from None
    return openvino_genai


def generation_config(genai, kind: str, max_new_tokens: int, temperature: float, seed: int | None, eos):
    c = genai.GenerationConfig()
    c.max_new_tokens = int(max_new_tokens)
    c.stop_token_ids = set(int(t) for t in eos)
    if temperature > 0:
        c.do_sample = True
        c.temperature = float(temperature)
        c.top_p = 1.0
        if seed is not None:
            c.rng_seed = int(seed)
    else:
        c.do_sample = False
    if kind in ("draft", "pld"):
        c.num_assistant_tokens = NUM_ASSISTANT_TOKENS
    if kind == "pld":
        c.max_ngram_size = MAX_NGRAM_SIZE
    return c


def turn_result(tokens, finish_stop: bool, step_tokens, ttft_ms: float | None, drafted: int | None,
                accepted: int | None, prompt_tokens: int, wall_s: float, eos: list[int], tokenizer) -> TurnResult:
    """One answer as a TurnResult. step_tokens: the tokens each target step emitted (the pipeline's
    raw_metrics.m_batch_sizes: one entry per target forward, the prefill's first), which give the
    forwards and, for prompt lookup, the accepted draft tokens. An answer that stopped on an end token
    counts that token, as the engine does."""
    ids = [int(t) for t in tokens]
    if finish_stop and eos and (not ids or ids[-1] not in eos):
        ids.append(int(eos[0]))
    steps = [int(n) for n in step_tokens or []]
    forwards = len(steps) if steps and sum(steps) == len([int(t) for t in tokens]) else None
    if accepted is None and forwards is not None:
        accepted = sum(steps) - len(steps)
    return TurnResult(token_ids=ids, text=tokenizer.decode(ids, skip_special_tokens=True),
                      finish_reason="eos" if finish_stop else "length", wall_s=wall_s, prompt_tokens=prompt_tokens,
                      target_forwards=forwards, mean_accepted=len(ids) / forwards if forwards else None,
                      prefill_s=ttft_ms / 1000 if ttft_ms is not None else None, drafted=drafted,
                      draft_accepted=accepted)


class OpenVINORunner(Runner):
    def __init__(self, ctx: BenchContext, kind: str):
        genai = _genai()
        a = ctx.args
        threads = torch.get_num_threads()  # the bench's own (bench/runner.py sets it)
        props = {"INFERENCE_NUM_THREADS": threads}
        kw = dict(props)
        if kind == "draft":
            kw["draft_model"] = genai.draft_model(str(export_dir(a.draft_model)), "CPU", **props)
        elif kind == "pld":
            kw["prompt_lookup"] = True
        try:
            self.pipe = genai.LLMPipeline(str(export_dir(a.model)), "CPU", **kw)
        except RuntimeError as e:
            raise HydraspecError(f"OpenVINO GenAI could not load {a.model}'s export: {str(e)[:300]}") from None
        self.genai, self.kind, self.tok, self.eos = genai, kind, ctx.tokenizer, sorted(ctx.eos)

    def generate(self, ids, max_new_tokens, temperature, seed):
        import openvino  # optional

        cfg = generation_config(self.genai, self.kind, max_new_tokens, temperature, seed, self.eos)
        x = openvino.Tensor(np.array([list(map(int, ids))], dtype=np.int64))
        t0 = time.perf_counter()
        res = self.pipe.generate(x, cfg)
        wall = time.perf_counter() - t0
        pm = res.perf_metrics
        drafted = accepted = None
        ext = getattr(res, "extended_perf_metrics", None)
        if ext is not None and hasattr(ext, "get_num_draft_tokens"):  # the draft model's pipeline
            drafted, accepted = int(ext.get_num_draft_tokens()), int(ext.get_num_accepted_tokens())
        finish = res.finish_reasons[0] if getattr(res, "finish_reasons", None) else None
        return turn_result(res.tokens[0], int(getattr(finish, "value", finish) or 0) == FINISH_STOP,
                           list(pm.raw_metrics.m_batch_sizes), float(pm.get_ttft().mean), drafted, accepted,
                           len(ids), wall, self.eos, self.tok)


for _kind, _help in (("ar", "OpenVINO GenAI's LLMPipeline on an int4 export of the model, plain decoding"),
                     ("draft", "OpenVINO GenAI with --draft-model's int4 export as draft (num_assistant_tokens 5)"),
                     ("pld", "OpenVINO GenAI prompt lookup (num_assistant_tokens 5, max_ngram_size 3)")):
    register(MethodSpec(f"ov-{_kind}", partial(OpenVINORunner, kind=_kind), _help, needs_draft=_kind == "draft",
                        settings=("draft_model",) if _kind == "draft" else ()))
