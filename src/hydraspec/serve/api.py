"""The OpenAI-style API of `hydraspec serve`: the server's settings, errors as OpenAI error objects, and the
request bodies (pydantic models) with their text content."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel, Field

__all__ = ["ServerConfig", "ApiError", "error_body", "SamplingBody", "ChatMessage", "ChatRequest", "CompletionRequest",
           "message_text", "content_text", "prediction_text"]


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


class SamplingBody(BaseModel):
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


class ChatRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(SamplingBody):
    prompt: Union[str, list[int]]
    echo: bool = False


def message_text(m: ChatMessage) -> str:
    return content_text(m.content, "messages")


def content_text(content, param: str) -> str:
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
    return content_text(prediction.get("content"), "prediction") or None
