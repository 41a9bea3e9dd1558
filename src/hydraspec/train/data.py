"""Self-distillation data: the base model answers prompts itself; only token ids are stored."""
from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm


def answer_prompts(model, tokenizer, questions, out_path, max_new_tokens: int = 256, progress: bool = True) -> int:
    """Greedy answers of the base model to each question's first turn, appended to a jsonl file
    ({"id", "prompt_ids", "answer_ids"}) as soon as each is done, so an interrupted run resumes where
    it stopped. questions: iterable of (id, list of user turns). Returns how many were added."""
    from ..generator import SpeculativeGenerator

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            try:
                done.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError):
                pass  # a line cut off by an interrupt is redone
    todo = [(qid, turns) for qid, turns in questions if qid not in done]
    gen = SpeculativeGenerator(model, tokenizer)
    added = 0
    with out.open("a") as f:
        for qid, turns in tqdm(todo, desc="answering", unit="prompt", disable=not progress):
            ids = gen.encode([{"role": "user", "content": turns[0]}])
            res = gen.generate(input_ids=ids, max_new_tokens=max_new_tokens)
            f.write(json.dumps({"id": qid, "prompt_ids": ids, "answer_ids": res.token_ids}) + "\n")
            f.flush()
            added += 1
    return added


def load_answers(path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
