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
    answers that many prompts per call of transformers' generate (left padding, prompts sorted by
    length), which is several times faster per token on a CPU too; it also hands the base model's last
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
    import torch

    from ..generator import eos_ids

    eos = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos) if eos else 0
    enc = sorted(((qid, gen.encode([{"role": "user", "content": turns[0]}])) for qid, turns in todo),
                 key=lambda x: len(x[1]))
    added = 0
    capture = base_cache is not None and base_cache.max_bytes > 0
    bar = tqdm(total=len(enc), desc="answering", unit="prompt", disable=not progress)
    with out.open("a") as f, torch.inference_mode():
        for b in range(0, len(enc), batch_size):
            chunk = enc[b:b + batch_size]
            width = max(len(ids) for _, ids in chunk)
            inp = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in chunk], device=model.device)
            att = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in chunk], device=model.device)
            res = model.generate(input_ids=inp, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad, eos_token_id=sorted(eos) or None,
                                 output_hidden_states=capture, return_dict_in_generate=True)
            steps = [st[-1] for st in res.hidden_states] if capture else []  # last layer, per generation step
            later = torch.cat(steps[1:], dim=1) if len(steps) > 1 else None  # [B, steps - 1, dim]
            for b, ((qid, ids), row) in enumerate(zip(chunk, res.sequences[:, width:].tolist())):
                ans = []
                for t in row:
                    ans.append(t)
                    if t in eos:
                        break
                rec = {"id": qid, "prompt_ids": ids, "answer_ids": ans}
                f.write(json.dumps(rec) + "\n")
                added += 1
                if capture:  # states of the prompt (prefill) and of every answer token but the last
                    parts = [steps[0][b, width - len(ids):]]
                    if len(ans) > 1 and later is not None:
                        parts.append(later[b, : len(ans) - 1])
                    base_cache.put(rec, torch.cat(parts))
            f.flush()
            bar.update(len(chunk))
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
