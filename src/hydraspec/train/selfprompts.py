"""Chat prompts written by the model itself (Magpie, Xu et al. 2024): given its chat template up to the
start of a user turn, an instruction-tuned model writes a plausible user message. Sampled from the
model's own distribution, these prompts cost no download and carry no licence but the model's; its greedy
answers to them are self-distillation data for draft heads on chat, where a handful of shipped
question sets is far too little.

A short opener after the user-turn header (a word or two such as "Explain", "Write a short story",
"Summarize") spreads the prompts over kinds of request; a code model left alone asks mostly for code.
Prompts that run past the token limit without closing the turn, that are very short, or that repeat an
earlier one are dropped.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from tqdm import tqdm

from ..batch import BatchGenerator
from ..errors import HydraspecError

OPENERS = (
    "Explain", "Write a short story", "Write a poem", "Write an email", "Write a blog post", "Summarize",
    "What are the main differences between", "What is", "Why do", "How can I", "How do I", "Give me tips",
    "Compare", "Describe", "List", "Can you help me", "I need", "I am planning", "I'm writing", "Imagine",
    "Pretend you are", "Translate", "Rewrite", "Suggest", "Create a plan", "What would happen if",
    "Is it true that", "Help me understand", "Draft", "Brainstorm", "Tell me about", "Outline",
    "What are some", "Classify", "Solve", "Calculate", "Analyze", "Argue", "Design", "Recommend",
    "Write a Python function", "Fix this code", "Write a SQL query", "Explain this code",
)

_MARK = "\u2063HYDRASPEC_USER_TURN\u2063"


def user_turn_prefix(tokenizer) -> str:
    """The chat template's text before a user message's content (system prompt included)."""
    if not getattr(tokenizer, "chat_template", None):
        raise HydraspecError("self-written prompts need a tokenizer with a chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=False)
    if _MARK not in text:
        raise HydraspecError("the chat template does not show the user's message as it is")
    return text.split(_MARK)[0]


def load_self_prompts(path) -> list[tuple[str, list[str]]]:
    """(id, [prompt]) pairs from a file written by :func:`self_prompts` (Spec-Bench format)."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            q = json.loads(line)
            out.append((f"{q['category']}-{q['question_id']}", list(q["turns"])))
        except (json.JSONDecodeError, KeyError):
            continue  # a line cut off by an interrupt
    return out


def self_prompts(model, tokenizer, n: int, out_path, seed: int = 0, batch_size: int = 8, max_tokens: int = 96,
                 temperature: float = 1.0, top_k: int = 50, top_p: float = 0.95, openers=OPENERS,
                 progress: bool = True) -> list[tuple[str, list[str]]]:
    """Up to ``n`` user prompts written by the model, appended to ``out_path`` (Spec-Bench format, category
    "self") as they are made, so that a second call with the same file goes on where the first stopped.
    Returns all the file's prompts as (id, [prompt]) pairs. Sampled: ``seed`` fixes the openers and draws."""
    if n < 1:
        raise HydraspecError(f"the number of self-written prompts must be at least 1, got {n}")
    prefix = user_turn_prefix(tokenizer)
    have = load_self_prompts(out_path)
    seen = {turns[0].strip().lower() for _, turns in have}
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    bar = tqdm(total=n, initial=min(n, len(have)), desc="writing prompts", unit="prompt", disable=not progress)
    rounds, made = 0, len(have)
    gen = BatchGenerator(model, tokenizer)
    with out.open("a") as f:
        while made < n and rounds < 50:
            want = min(4 * batch_size, 2 * (n - made))
            # each round draws anew, so a resumed run does not repeat the prompts of the round it redoes
            round_rng = random.Random(f"{seed}-{rounds}-{made}")
            chosen = [round_rng.choice(openers) for _ in range(want)]
            ids = [tokenizer(prefix + o, add_special_tokens=False)["input_ids"] for o in chosen]
            res = gen.generate(input_ids=ids, max_new_tokens=max_tokens, batch_size=batch_size,
                               temperature=temperature, top_k=top_k, top_p=top_p, seed=rng.randrange(1 << 30))
            rounds += 1
            for opener, r in zip(chosen, res):
                if made >= n:
                    break
                if r.finish_reason != "eos":
                    continue  # ran past the limit: not a finished user turn
                text = (opener + tokenizer.decode(r.token_ids, skip_special_tokens=True)).strip()
                key = text.lower()
                if len(text) < 20 or key in seen:
                    continue
                seen.add(key)
                f.write(json.dumps({"question_id": made, "category": "self", "turns": [text]}) + "\n")
                f.flush()
                made += 1
                bar.update(1)
    bar.close()
    return load_self_prompts(out_path)[:n]
