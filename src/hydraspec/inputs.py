"""What a request brings: prompt encoding (chat template), the model's end-of-sequence ids, and the checks
of a prompt's length and of the sampling settings that every entry point (generate, batches, the server)
applies the same way."""
from __future__ import annotations

from .cache import text_config
from .errors import HydraspecError

__all__ = ["encode_prompt", "eos_ids", "context_limit", "sliding_window", "check_length", "check_sampling"]


def encode_prompt(tokenizer, prompt, chat: bool = True) -> list[int]:
    """A string or a list of {"role", "content"} messages -> prompt token ids. The chat template is
    applied when the tokenizer has one (a plain string becomes one user message)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise HydraspecError("the prompt is empty")
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = list(prompt)
        if not messages:
            raise HydraspecError("the conversation is empty")
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in messages)
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if not ids:
        raise HydraspecError("the prompt encodes to no tokens")
    return list(ids)


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if e is None:
            continue
        ids.update(e if isinstance(e, (list, tuple)) else [e])
    return {int(i) for i in ids if i is not None}


def context_limit(model) -> int | None:
    return getattr(text_config(model), "max_position_embeddings", None)


def sliding_window(model) -> int | None:
    cfg = text_config(model)
    return getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None


def check_length(model, n_prompt: int, max_new_tokens: int, what: str = "prompt") -> None:
    """Refuse a prompt that, with its token budget, does not fit the model's context or sliding window."""
    if max_new_tokens <= 0:
        raise HydraspecError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if n_prompt <= 0:
        raise HydraspecError(f"{what} is empty")
    total = n_prompt + max_new_tokens
    ctx, window = context_limit(model), sliding_window(model)
    if ctx and total > ctx:
        raise HydraspecError(f"{what} ({n_prompt} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"model's context of {ctx} tokens")
    if window and total > window:
        raise HydraspecError(f"{what} + max_new_tokens ({total}) exceeds the model's sliding window "
                             f"({window}); tree attention over a sliding window is not supported")


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if temperature < 0 or not (0 < top_p <= 1) or top_k < 0:
        raise HydraspecError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
