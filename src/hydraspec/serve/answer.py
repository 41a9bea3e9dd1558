"""Answering one OpenAI-style request on the engine worker: the engine :class:`~hydraspec.engine.Request` built
from the body (its limits checked against the server's context), its events awaited, and the answer sent as
one JSON body or as a stream of server-sent events."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import anyio
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine import Request
from ..sampling import Sampling
from .api import ApiError, SamplingBody, ServerConfig, error_body, prediction_text
from .worker import EngineWorker, QueueFull

__all__ = ["Answers", "ClosingStream", "TextDeltas", "sse"]


class ClosingStream(StreamingResponse):
    """A streaming response that closes its body generator when the response ends, however it ends. When a
    client leaves, Starlette cancels the sending task wherever it waits; if that is inside ``send`` (the
    middleware's stream), the body generator is left suspended and its ``finally`` (which frees the engine
    row) would run only when the garbage collector finds it."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


class TextDeltas:
    """Text increments of a growing token list: held back while a stop string may still be forming and
    while the last character is an incomplete multi-byte sequence."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""
        self.hold = max((len(s) for s in stops), default=1) - 1

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
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


def finish_reason(result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def usage(result) -> dict:
    s = result.stats
    details = {k: s.counters.get(k, 0) for k in ("accepted_prediction_tokens", "rejected_prediction_tokens")}
    return {"prompt_tokens": len(result.prompt_ids), "completion_tokens": len(result.token_ids),
            "total_tokens": len(result.prompt_ids) + len(result.token_ids),
            "prompt_tokens_details": {"cached_tokens": s.counters.get("cached_tokens", 0)},
            "completion_tokens_details": {"reasoning_tokens": 0, **details},
            "mean_accepted_tokens_per_forward": round(s.mean_accepted, 4)}


class Answers:
    """Requests in, answers out, for one worker and tokenizer; ``on_done(result)`` is told of each finished
    request (the metrics)."""

    def __init__(self, worker: EngineWorker, tokenizer, config: ServerConfig, on_done=None):
        self.worker, self.tokenizer, self.config = worker, tokenizer, config
        self.on_done = on_done or (lambda result: None)

    def check_model(self, name: str) -> None:
        config = self.config
        if name != config.model_name:
            raise ApiError(404, f"the model '{name}' does not exist; this server has '{config.model_name}'",
                           param="model", code="model_not_found")

    def build(self, body: SamplingBody, ids: list[int]) -> Request:
        config = self.config
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
        pred = self.tokenizer(predicted, add_special_tokens=False)["input_ids"] if predicted else None
        return Request(ids=ids, max_new_tokens=max_tokens, sampling=sampling, seed=body.seed,
                       stops=[s for s in stops if s], prediction=pred)

    async def run(self, req: Request, stream_events: bool):
        """Submit; yields ("tokens", ids) events (when streaming) and finally ("done", result)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def on_event(kind, payload):
            if kind == "tokens" and not stream_events:
                return
            loop.call_soon_threadsafe(q.put_nowait, (kind, payload))
        try:
            self.worker.submit(req, on_event)
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
                    self.on_done(payload)
                    yield kind, payload
                    return
                yield kind, payload
        finally:
            if not finished:  # the client went away: free the row
                self.worker.cancel(req)

    async def respond(self, req: Request, body: SamplingBody, kind: str, echo_text: str = ""):
        """The answer to ``req``: one JSON body, or (``body.stream``) a stream of server-sent events."""
        ids = _Ids(kind, self.config.model_name)
        if not body.stream:
            result = None
            async for ev, payload in self.run(req, False):
                result = payload
            text = echo_text + result.text
            choice = {"index": 0, "finish_reason": finish_reason(result), "logprobs": None}
            if kind == "chat":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return JSONResponse({"id": ids.rid, "object": ids.obj, "created": ids.created, "model": ids.model,
                                 "choices": [choice], "usage": usage(result)})
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        events = self.run(req, True)
        try:  # a full queue is an error status, not an empty stream
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None
        stream = self._stream(req, ids, events, first, echo_text, include_usage)
        return ClosingStream(stream, media_type="text/event-stream")

    async def _stream(self, req: Request, ids: "_Ids", events, first, echo_text: str, include_usage: bool):
        deltas = TextDeltas(self.tokenizer, req.stops)
        try:
            yield sse(ids.chunk("" if ids.kind == "chat" else echo_text, None, role=True))
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
                        yield sse(ids.chunk(d, None))
                else:
                    rest = deltas.final(payload.text)
                    if rest:
                        yield sse(ids.chunk(rest, None))
                    yield sse(ids.chunk(None if ids.kind == "chat" else "", finish_reason(payload)))
                    if include_usage:
                        yield sse({"id": ids.rid, "object": f"{ids.obj}.chunk" if ids.kind == "chat" else ids.obj,
                                   "created": ids.created, "model": ids.model, "choices": [],
                                   "usage": usage(payload)})
                    break
        except ApiError as exc:  # after the stream began: an error event, as OpenAI-style servers send
            yield sse(error_body(exc.message, exc.kind, exc.param, exc.code))
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"


class _Ids:
    """One answer's id, object name, creation time and model, and its stream chunks."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.obj = "chat.completion" if kind == "chat" else "text_completion"

    def chunk(self, delta_text: str | None, finish: str | None, role: bool = False) -> dict:
        if self.kind == "chat":
            delta = {}
            if role:
                delta["role"] = "assistant"
            if delta_text is not None:
                delta["content"] = delta_text
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [choice]}
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}]}
