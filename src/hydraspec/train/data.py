"""Self-distillation data: the base model answers prompts itself; only token ids are stored."""
from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm


def answer_prompts(model, tokenizer, questions, out_path, max_new_tokens: int = 256, progress: bool = True,
                   batch_size: int = 1, base_cache=None) -> int:
    """Greedy answers of the base model to each question's first turn, appended to a jsonl file
    ({"id", "prompt_ids", "answer_ids"}) as soon as each is done (or each batch), so an interrupted
    run resumes where it stopped. questions: iterable of (id, list of user turns). batch_size > 1
    decodes that many prompts at once with continuous batching, which is several times faster per token
    on a CPU too; it also hands the base model's last
    hidden states of each answered sequence to `base_cache` (a trainer.BaseOutputs), so that training
    does not run the base model over them again. Returns how many were added."""
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
    if batch_size > 1:
        return _answer_batched(model, tokenizer, gen, todo, out, max_new_tokens, progress, batch_size, base_cache)
    added = 0
    with out.open("a") as f:
        for qid, turns in tqdm(todo, desc="answering", unit="prompt", disable=not progress):
            ids = gen.encode([{"role": "user", "content": turns[0]}])
            res = gen.generate(input_ids=ids, max_new_tokens=max_new_tokens)
            f.write(json.dumps({"id": qid, "prompt_ids": ids, "answer_ids": res.token_ids}) + "\n")
            f.flush()
            added += 1
    return added


def _answer_batched(model, tokenizer, gen, todo, out, max_new_tokens, progress, batch_size, base_cache=None) -> int:
    """Continuous batching (BatchGenerator, plain decoding): up to batch_size rows decode together and a
    finished row's place goes at once to the next prompt, so no row idles while the longest answer of its
    batch finishes. Each answer is written as soon as it is done, with its hidden states, which the
    decoding forwards computed anyway."""
    from ..batch import BatchGenerator

    if not todo:
        return 0
    enc = [(qid, gen.encode([{"role": "user", "content": turns[0]}])) for qid, turns in todo]
    capture = base_cache is not None and base_cache.max_bytes > 0
    added = 0
    bar = tqdm(total=len(enc), desc="answering", unit="prompt", disable=not progress)
    with out.open("a") as f:
        def done(i, res):
            nonlocal added
            qid, ids = enc[i]
            rec = {"id": qid, "prompt_ids": ids, "answer_ids": list(res.token_ids)}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            added += 1
            bar.update(1)
            if capture and res.hidden_states is not None:
                base_cache.put(rec, res.hidden_states[: base_cache.ids(rec).numel() - 1])
            res.hidden_states = None

        BatchGenerator(model, tokenizer).generate(input_ids=[ids for _, ids in enc], max_new_tokens=max_new_tokens,
                                                  batch_size=batch_size, keep_hidden=capture, on_result=done)
    bar.close()
    return added


def load_answers(path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
