"""The HTTP side of `hydraspec serve`: OpenAI-style endpoints (FastAPI, pydantic request models, server-sent
events for streaming), errors as OpenAI error objects, an optional API key, Prometheus metrics. The request
bodies and errors are :mod:`.api`; answering a request on the engine is :mod:`.answer`."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import asdict

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.exceptions import HTTPException

from ..errors import HydraspecError
from .answer import Answers
from .api import ApiError, ChatRequest, CompletionRequest, ServerConfig, error_body, message_text
from .worker import EngineWorker

__all__ = ["ServerConfig", "create_app"]


def create_app(worker: EngineWorker, tokenizer, encode, config: ServerConfig, start_worker: bool = True) -> FastAPI:
    """encode(prompt, chat) -> token ids (the generator's chat template). The worker is stopped with the
    app's lifespan, and started with it unless ``start_worker`` is False (the caller runs it)."""
    @asynccontextmanager
    async def lifespan(app):
        if start_worker:
            worker.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    app = FastAPI(title="hydraspec", lifespan=lifespan)
    metrics = _Metrics(worker)
    _add_error_handlers(app, config, metrics)
    answers = Answers(worker, tokenizer, config, on_done=metrics.done)
    _add_endpoints(app, answers, worker, tokenizer, encode, config, metrics)
    return app


class _Metrics:
    """The Prometheus registry: requests by endpoint and status, tokens, verify-step times, and the worker's
    live values (read when scraped)."""

    def __init__(self, worker: EngineWorker):
        self.worker = worker
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("hydraspec_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=registry)
        self.prompt = Counter("hydraspec_prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.generated = Counter("hydraspec_generated_tokens", "Tokens generated for finished requests",
                                 registry=registry)
        verify = Histogram("hydraspec_verify_step_seconds", "Time of one batched verify forward", registry=registry,
                           buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
        registry.register(self)
        self.worker.on_step = verify.observe

    def done(self, result) -> None:
        self.prompt.inc(len(result.prompt_ids))
        self.generated.inc(len(result.token_ids))

    def collect(self):  # values read from the worker when scraped
        worker = self.worker
        c = worker.counters
        yield GaugeMetricFamily("hydraspec_queue_length", "Requests waiting for a row", value=worker.queue_length)
        yield GaugeMetricFamily("hydraspec_running_rows", "Requests decoding now", value=worker.running_rows)
        yield GaugeMetricFamily("hydraspec_tokens_per_second", "Generated tokens per second over the last 10 s",
                                value=c.tokens_per_s())
        yield GaugeMetricFamily("hydraspec_mean_accepted_tokens_per_forward",
                                "Tokens emitted per row per target forward since start (1.0 = no speculation)",
                                value=c.tokens / c.row_forwards if c.row_forwards else 0.0)
        yield GaugeMetricFamily("hydraspec_verify_steps", "Batched verify forwards since start", value=c.steps)
        yield GaugeMetricFamily("hydraspec_row_forwards", "Target forwards of one row since start (a step of n rows "
                                                          "counts n)", value=c.row_forwards)
        yield GaugeMetricFamily("hydraspec_emitted_tokens", "Tokens emitted since start", value=c.tokens)


def _add_error_handlers(app: FastAPI, config: ServerConfig, metrics: _Metrics) -> None:
    """Errors as OpenAI error objects (never a traceback), the API key, and the requests counted."""
    @app.exception_handler(ApiError)
    async def _api_error(request: HTTPRequest, exc: ApiError):
        return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HTTPRequest, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg = "the request body is not valid JSON"
        return JSONResponse(error_body(f"{'.'.join(loc) + ': ' if loc else ''}{msg}", "invalid_request_error",
                                       ".".join(loc) or None), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: HTTPRequest, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.middleware("http")
    async def _auth_and_count(request: HTTPRequest, call_next):
        if config.api_key and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {config.api_key}":
                return JSONResponse(error_body("invalid or missing API key (Authorization: Bearer ...)",
                                               "authentication_error", code="invalid_api_key"), status_code=401)
        try:
            response = await call_next(request)
        except Exception as exc:  # never a traceback to the client
            response = JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), 500)
        metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response


def _add_endpoints(app: FastAPI, answers: Answers, worker: EngineWorker, tokenizer, encode, config: ServerConfig,
                   meter: _Metrics) -> None:
    @app.get("/health")
    async def health():
        out = {"status": "ok", "running_rows": worker.running_rows, "queue_length": worker.queue_length}
        if worker.learner is not None:
            out["learning"] = asdict(worker.learner.stats)
        return out

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "hydraspec"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(meter.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():  # vLLM's name: benchmarks start each run cold without a restart
        worker.forget()
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        answers.check_model(body.model)
        messages = [{"role": m.role if m.role != "developer" else "system", "content": message_text(m)}
                    for m in body.messages]
        try:
            ids = encode(messages, True)
        except HydraspecError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        req = answers.build(body, ids)
        return await answers.respond(req, body, "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        answers.check_model(body.model)
        try:
            ids = list(body.prompt) if isinstance(body.prompt, list) else encode(body.prompt, False)
        except HydraspecError as exc:
            raise ApiError(400, str(exc), param="prompt") from None
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        req = answers.build(body, ids)
        echo = (body.prompt if isinstance(body.prompt, str) else tokenizer.decode(ids)) if body.echo else ""
        return await answers.respond(req, body, "completion", echo)
