"""Start-up of `hydraspec serve`: the engine sized before any request (KV cache for every row at the full
context, refused up front when it does not fit), the adaptive draft rule measured on this device, uvicorn."""
from __future__ import annotations

import functools
import logging
import signal
import sys
import threading
import time

from ..batch import BatchGenerator
from ..memory import cache_bytes, gib, kv_bytes_per_slot
from ..errors import HydraspecError
from ..inputs import context_limit, encode_prompt
from ..adaptive import AdaptiveDraft
from ..verify_cost import stored_cost_path
from ..policy import LatencyCap
from ..prefix_pool import PrefixPool
from .app import ServerConfig, create_app
from .kept_answers import KeptAnswers
from .worker import EngineWorker

log = logging.getLogger("hydraspec.serve")


def build_server(bg: BatchGenerator, model_name: str, *, max_batch: int = 8, max_context: int | None = None,
                 max_queue: int = 64, api_key: str | None = None, adaptive: bool = True, say=print,
                 start_worker: bool = True, prefix_tokens: int = 0, prefill_chunk: int = 0,
                 max_step_cost: float = 0.0, keep_answers: str | None = None, keep_tokens: int = 2_000_000,
                 learner=None):
    """The FastAPI app and its worker for generator ``bg`` (model, tokenizer, drafter, acceptor).
    prefix_tokens: the prefix cache across requests holds up to this many tokens (0: none). prefill_chunk:
    while rows decode, a new request's prompt is read this many tokens a step inside their forwards (0: whole,
    at once). max_step_cost: no step costs more than this many plain steps of the rows that decode (drafts and
    chunks cut to fit; 0: no bound). keep_answers: a directory where every finished answer is kept as
    self-distillation data, at most keep_tokens tokens (hydraspec.serve.kept_answers; None: none kept).
    learner: heads that learn from the kept answers while the server is idle (hydraspec.serve.learn.HeadLearner;
    its directory keeps the answers when keep_answers is None)."""
    if max_batch < 1:
        raise HydraspecError(f"--max-batch must be at least 1, got {max_batch}")
    if max_queue < 0:
        raise HydraspecError(f"--max-queue must be at least 0, got {max_queue}")
    ctx = context_limit(bg.model) or 4096
    context = min(ctx, max_context or min(ctx, 4096))
    if context < 16:
        raise HydraspecError(f"--max-context must be at least 16 tokens, got {context}")
    capacity = context + bg.max_nodes + 1
    need = bg.estimate_bytes([context] * max_batch, 0)  # capacity slots per row, target + draft model
    bg.check_memory(need, max_batch, None, bg.logits_bytes(max_batch))
    if adaptive and bg.drafter.max_nodes > 0:
        stored = stored_cost_path(bg.model)
        say(f"the verify cost for the adaptive draft length: read back from {stored}" if stored is not None
            and stored.exists() else "measuring the verify cost for the adaptive draft length ...")
    bg.adaptive = adaptive
    if prefix_tokens > 0:
        bg.prefix_pool = PrefixPool(prefix_tokens)
        say(f"prefix cache: up to {prefix_tokens} tokens ({gib(prefix_tokens * kv_bytes_per_slot(bg.model))}) of "
            "earlier prompts and answers")
    bg.prefill_chunk = prefill_chunk
    if max_step_cost < 0:
        raise HydraspecError(f"--max-step-cost must be 0 (no bound) or more, got {max_step_cost}")
    bg.max_step_cost = max_step_cost
    rule = bg.policy(serving=True)
    engine = bg.engine(max_batch, capacity, keep_hidden=learner is not None, policy=rule)  # a learner's data
    if prefill_chunk and not engine.prefill_chunk:
        say("prompts are read whole when they join (chunked prefill needs packed rows: the CPU backend)")
    inner = rule.inner if isinstance(rule, LatencyCap) else rule
    if isinstance(inner, AdaptiveDraft):
        say(f"adaptive speculation: {inner.describe()}")
    if isinstance(rule, LatencyCap):
        rooms = f"1 row alone -> {rule.room(1, alone=True)}, " + ", ".join(f"{r} rows -> {rule.room(r)}"
                                                                      for r in (1, 2, 4, 8))
        say(f"every step within {max_step_cost:g} plain steps: tokens beside one a row (drafts, prompt chunks): {rooms}")
    say(f"KV cache: {max_batch} rows x {capacity} slots = {gib(cache_bytes(bg.model, max_batch, capacity))} "
        f"(target{' + draft model' if need > cache_bytes(bg.model, max_batch, capacity) else ''}: {gib(need)}), "
        f"allocated now; context {context} tokens per request")
    if learner is not None and not keep_answers:
        keep_answers = str(learner.dir)
    keep = KeptAnswers(keep_answers, keep_tokens) if keep_answers else None
    if keep is not None:
        say(f"keeping every answer as training data in {keep.path} ({keep.tokens} of at most {keep_tokens} "
            "tokens there now; hydraspec train-heads --data reads it)")
    if learner is not None:
        st = learner.stats
        say(f"learning: {learner.drafters[0].heads.kind} heads in {learner.dir / 'heads'} train on the answers while "
            f"no request runs ({st.answers} answers to train on, {st.heldout} held out, {st.steps} steps so far; "
            "learning keeps the hidden states of whole prompts, so the prefix cache and chunked prefill are off)")
    worker = EngineWorker(engine, max_queue, keep, learner)
    config = ServerConfig(model_name=model_name, capacity=capacity, max_nodes=bg.max_nodes, api_key=api_key)
    app = create_app(worker, bg.tokenizer, functools.partial(encode_prompt, bg.tokenizer), config, start_worker)
    return app, worker, rule


def run(app, worker: EngineWorker, host: str, port: int) -> None:
    """Serve until Ctrl-C / SIGTERM: HTTP (uvicorn) in a background thread, the engine in this one (built with
    start_worker=False). On a signal the open requests are cancelled, uvicorn stops and the call returns."""
    import uvicorn  # optional

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5))
    http = threading.Thread(target=server.run, name="hydraspec-http", daemon=True)

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, interrupt)
    http.start()
    while not server.started:
        if not http.is_alive():
            signal.signal(signal.SIGTERM, previous)
            raise HydraspecError(f"could not listen on {host}:{port} (see the message above)")
        time.sleep(0.05)
    try:
        worker.run()
    except KeyboardInterrupt:
        pass
    finally:
        quiet = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        server.should_exit = True
        http.join(15)
        signal.signal(signal.SIGINT, quiet)
        signal.signal(signal.SIGTERM, previous)
    print("hydraspec serve: stopped", file=sys.stderr)
