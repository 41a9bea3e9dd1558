"""What a request brings: prompt encoding (chat template), the model's end-of-sequence ids, and the checks
of a prompt's length and of the sampling settings that every entry point (generate, batches, the server)
applies the same way, and the prompt files of the command line."""
from __future__ import annotations

import json
from pathlib import Path

from .cache import text_config
from .errors import HydraspecError

__all__ = ["encode_prompt", "eos_ids", "context_limit", "sliding_window", "check_length", "check_sampling",
           "read_prompt_lines", "load_batch_trees", "prompt_ids"]


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
    """Refuse a prompt that, with its token budget, does not fit the model's context."""
    if max_new_tokens <= 0:
        raise HydraspecError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if n_prompt <= 0:
        raise HydraspecError(f"{what} is empty")
    total = n_prompt + max_new_tokens
    ctx = context_limit(model)
    if ctx and total > ctx:
        raise HydraspecError(f"{what} ({n_prompt} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"model's context of {ctx} tokens")


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if temperature < 0 or not (0 < top_p <= 1) or top_k < 0:
        raise HydraspecError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")


def read_prompt_lines(path: str) -> list:
    """A prompt file for batched generation: one prompt per non-empty line, either plain text or JSON (a
    string, a message list, or an object with "prompt", "turns" (first turn used) or "messages")."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln.rstrip("\n") for ln in f]
    except OSError as e:
        raise HydraspecError(f"cannot read prompt file '{path}': {e.strerror}") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        p = line
        if line.lstrip()[:1] in "{[\"":
            try:
                p = json.loads(line)
            except json.JSONDecodeError:
                p = line
        if isinstance(p, dict):
            if "prompt" in p:
                p = p["prompt"]
            elif "turns" in p and p["turns"]:
                p = p["turns"][0]
            elif "messages" in p:
                p = p["messages"]
            else:
                raise HydraspecError(f"{path}:{n}: a JSON prompt needs 'prompt', 'turns' or 'messages'")
        if isinstance(p, str) and not p.strip():
            continue
        prompts.append(p)
    if not prompts:
        raise HydraspecError(f"prompt file '{path}' holds no prompts")
    return prompts


def load_batch_trees(text: str | None) -> dict[int, list[list[int]]] | None:
    """--batch-trees: a JSON file or JSON object {"1": paths, "8": paths, ...}."""
    if not text:
        return None
    try:
        data = json.loads(Path(text).read_text()) if Path(text).exists() else json.loads(text)
    except json.JSONDecodeError as e:
        raise HydraspecError(f"--batch-trees {text!r} is neither a JSON file nor JSON: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("by_batch"), dict):  # a tree.json of build-tree --batch-sizes
        data = data["by_batch"]
    if not isinstance(data, dict) or not data:
        raise HydraspecError("--batch-trees takes a JSON object {batch_size: [[0], [0, 0], ...], ...} "
                             "or a tree.json written by build-tree --batch-sizes")
    try:
        return {int(k): v for k, v in data.items()}
    except ValueError:
        raise HydraspecError(f"--batch-trees keys must be batch sizes (integers), got {list(data)}") from None


def prompt_ids(tokenizer, prompts, input_ids, chat: bool) -> list[list[int]]:
    """Token ids of a batch's prompts: strings, message lists or token-id lists (or ``input_ids``)."""
    if input_ids is not None:
        return [list(map(int, x)) for x in input_ids]
    if prompts is None or isinstance(prompts, str):
        raise HydraspecError("generate_batch takes a list of prompts")
    return [[int(t) for t in p] if is_ids(p) else encode_prompt(tokenizer, p, chat) for p in prompts]


def is_ids(p) -> bool:
    """A prompt given as token ids (a non-empty list/tuple of ints or a 1D tensor) rather than text/messages."""
    if hasattr(p, "dim"):
        return p.dim() == 1
    return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(t, int) for t in p)
