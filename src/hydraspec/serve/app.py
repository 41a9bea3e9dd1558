"""The HTTP side of `hydraspec serve`: OpenAI-style endpoints (FastAPI, pydantic request models, server-sent
events for streaming), errors as OpenAI error objects, an optional API key, Prometheus metrics."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, Union

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from ..engine import Request
from ..errors import HydraspecError
from ..sampling import Sampling
from .worker import EngineWorker, QueueFull


@dataclass
class ServerConfig:
    model_name: str
    capacity: int  # cache slots per row
    max_nodes: int  # most draft nodes a row can add to a verify step
    api_key: str | None = None
    default_max_tokens: int = 512


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def error_body(message: str, kind: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# -- request models --------------------------------------------------------------------------------------


class _Sampling(BaseModel):
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # an extension
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    prediction: dict[str, Any] | None = None  # OpenAI's predicted outputs: {"type": "content", "content": ...}


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int]]
    echo: bool = False


def _text_content(m: ChatMessage) -> str:
    return _text(m.content, "messages")


def _text(content, param: str) -> str:
    """A content string, or the text of a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        if not isinstance(p, dict) or p.get("type") != "text":
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise ApiError(400, f"content of type {kind!r} is not supported (text only)", param=param)
        parts.append(str(p.get("text", "")))
    return "".join(parts)


def prediction_text(prediction: dict | None) -> str | None:
    """The text of a predicted output ({"type": "content", "content": str or text parts}), or None."""
    if prediction is None:
        return None
    if prediction.get("type") != "content":
        raise ApiError(400, "prediction.type must be 'content'", param="prediction")
    return _text(prediction.get("content"), "prediction") or None


# -- the app -------------------------------------------------------------------------------------------


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
    registry = CollectorRegistry()
    m_requests = Counter("hydraspec_requests", "Requests answered, by endpoint and HTTP status",
                         ["endpoint", "status"], registry=registry)
    m_prompt = Counter("hydraspec_prompt_tokens", "Prompt tokens of finished requests", registry=registry)
    m_gen = Counter("hydraspec_generated_tokens", "Tokens generated for finished requests", registry=registry)
    m_verify = Histogram("hydraspec_verify_step_seconds", "Time of one batched verify forward", registry=registry,
                         buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))

    class Live:  # values read from the worker when scraped
        def collect(self):
            c = worker.counters
            yield GaugeMetricFamily("hydraspec_queue_length", "Requests waiting for a row", value=worker.queue_length)
            yield GaugeMetricFamily("hydraspec_running_rows", "Requests decoding now", value=worker.running_rows)
            yield GaugeMetricFamily("hydraspec_tokens_per_second", "Generated tokens per second over the last 10 s",
                                    value=c.tokens_per_s())
            yield GaugeMetricFamily("hydraspec_mean_accepted_tokens_per_forward",
                                    "Tokens emitted per row per target forward since start (1.0 = no speculation)",
                                    value=c.tokens / c.row_forwards if c.row_forwards else 0.0)
            yield GaugeMetricFamily("hydraspec_verify_steps", "Batched verify forwards since start", value=c.steps)

    registry.register(Live())
    worker.on_step = m_verify.observe

    # -- errors ------------------------------------------------------------------------------------------
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
        m_requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    # -- helpers -----------------------------------------------------------------------------------------
    def check_model(name: str) -> None:
        if name != config.model_name:
            raise ApiError(404, f"the model '{name}' does not exist; this server has '{config.model_name}'",
                           param="model", code="model_not_found")

    def build(body: _Sampling, ids: list[int]) -> Request:
        if body.n != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        room = config.capacity - config.max_nodes - 1 - len(ids)
        limit = config.capacity - config.max_nodes - 1
        if room < 1:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's context holds at most {limit} "
                                f"tokens of prompt and answer together (--max-context)", param="messages",
                           code="context_length_exceeded")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = min(config.default_max_tokens, room)
        if max_tokens < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if max_tokens > room:
            raise ApiError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds this server's "
                                f"context of {limit} tokens (--max-context)", param="max_tokens",
                           code="context_length_exceeded")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > 4:
            raise ApiError(400, "at most 4 stop sequences", param="stop")
        sampling = Sampling(body.temperature, body.top_k, body.top_p)
        predicted = prediction_text(body.prediction)
        pred = tokenizer(predicted, add_special_tokens=False)["input_ids"] if predicted else None
        return Request(ids=ids, max_new_tokens=max_tokens, sampling=sampling, seed=body.seed,
                       stops=[s for s in stops if s], prediction=pred)

    def finish_reason(result) -> str:
        return "length" if result.finish_reason == "length" else "stop"

    def usage(result) -> dict:
        s = result.stats
        details = {k: s.counters.get(k, 0) for k in ("accepted_prediction_tokens", "rejected_prediction_tokens")}
        return {"prompt_tokens": len(result.prompt_ids), "completion_tokens": len(result.token_ids),
                "total_tokens": len(result.prompt_ids) + len(result.token_ids),
                "completion_tokens_details": {"reasoning_tokens": 0, **details},
                "mean_accepted_tokens_per_forward": round(s.mean_accepted, 4)}

    async def run(req: Request, stream_events: bool):
        """Submit; yields ("tokens", ids) events (when streaming) and finally ("done", result)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def on_event(kind, payload):
            if kind == "tokens" and not stream_events:
                return
            loop.call_soon_threadsafe(q.put_nowait, (kind, payload))
        try:
            worker.submit(req, on_event)
        except QueueFull as exc:
            raise ApiError(429, str(exc), kind="rate_limit_error", code="queue_full") from None
        finished = False
        try:
            while True:
                kind, payload = await q.get()
                if kind == "done":
                    finished = True
                    if payload is None:
                        raise ApiError(500, "the engine refused the request", kind="server_error")
                    if payload.finish_reason == "cancelled":  # shutting down, or a failed step: not an answer
                        raise ApiError(503, "the server cancelled this request before it finished (it is shutting "
                                            "down or a decoding step failed)", kind="server_error", code="cancelled")
                    m_prompt.inc(len(payload.prompt_ids))
                    m_gen.inc(len(payload.token_ids))
                    yield kind, payload
                    return
                yield kind, payload
        finally:
            if not finished:  # the client went away: free the row
                worker.cancel(req)

    class TextDeltas:
        """Text increments of a growing token list: held back while a stop string may still be forming and
        while the last character is an incomplete multi-byte sequence."""

        def __init__(self, stops: list[str]):
            self.ids: list[int] = []
            self.sent = ""
            self.hold = max((len(s) for s in stops), default=1) - 1

        def add(self, ids: list[int]) -> str:
            self.ids.extend(ids)
            text = tokenizer.decode(self.ids, skip_special_tokens=True)
            text = text.rstrip("\ufffd")
            safe = text[: len(text) - self.hold] if self.hold else text
            if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
                return ""
            delta, self.sent = safe[len(self.sent):], safe
            return delta

        def final(self, text: str) -> str:
            return text[len(self.sent):] if text.startswith(self.sent) else ""

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def respond(req: Request, body: _Sampling, kind: str, echo_text: str = ""):
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"
        if not body.stream:
            result = None
            async for ev, payload in run(req, False):
                result = payload
            text = echo_text + result.text
            choice = {"index": 0, "finish_reason": finish_reason(result), "logprobs": None}
            if kind == "chat":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": config.model_name,
                                 "choices": [choice], "usage": usage(result)})

        include_usage = bool((body.stream_options or {}).get("include_usage"))
        events = run(req, True)
        try:  # a full queue is an error status, not an empty stream
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None

        def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> dict:
            if kind == "chat":
                delta = {}
                if role:
                    delta["role"] = "assistant"
                if delta_text is not None:
                    delta["content"] = delta_text
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": config.model_name,
                        "choices": [choice]}
            return {"id": rid, "object": "text_completion", "created": created, "model": config.model_name,
                    "choices": [{"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}]}

        async def gen():
            deltas = TextDeltas(req.stops)
            try:
                yield sse(chunk("" if kind == "chat" else echo_text, None, role=True))
                pending = [first] if first is not None else []
                while True:
                    if pending:
                        ev, payload = pending.pop()
                    else:
                        try:
                            ev, payload = await events.__anext__()
                        except StopAsyncIteration:
                            break
                    if ev == "tokens":
                        d = deltas.add(payload)
                        if d:
                            yield sse(chunk(d, None))
                    else:
                        rest = deltas.final(payload.text)
                        if rest:
                            yield sse(chunk(rest, None))
                        yield sse(chunk(None if kind == "chat" else "", finish_reason(payload)))
                        if include_usage:
                            yield sse({"id": rid, "object": f"{obj}.chunk" if kind == "chat" else obj,
                                       "created": created, "model": config.model_name, "choices": [],
                                       "usage": usage(payload)})
                        break
            except ApiError as exc:  # after the stream began: an error event, as OpenAI-style servers send
                yield sse(error_body(exc.message, exc.kind, exc.param, exc.code))
            finally:
                await events.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    # -- endpoints ---------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok", "running_rows": worker.running_rows, "queue_length": worker.queue_length}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "hydraspec"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        check_model(body.model)
        messages = [{"role": m.role if m.role != "developer" else "system", "content": _text_content(m)}
                    for m in body.messages]
        try:
            ids = encode(messages, True)
        except HydraspecError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        req = build(body, ids)
        return await respond(req, body, "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body.model)
        try:
            ids = list(body.prompt) if isinstance(body.prompt, list) else encode(body.prompt, False)
        except HydraspecError as exc:
            raise ApiError(400, str(exc), param="prompt") from None
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        req = build(body, ids)
        echo = (body.prompt if isinstance(body.prompt, str) else tokenizer.decode(ids)) if body.echo else ""
        return await respond(req, body, "completion", echo)

    return app
