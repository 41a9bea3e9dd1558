"""Self-distillation data: the base model answers prompts itself; only token ids are stored."""
from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from ..batch import BatchGenerator
from ..drafters import make_drafter
from ..errors import HydraspecError
from ..inputs import encode_prompt


def answer_prompts(model, tokenizer, questions, out_path, max_new_tokens: int = 256, progress: bool = True,
                   batch_size: int = 1, base_cache=None, method: str = "ar") -> int:
    """Greedy answers of the base model to each question's first turn, appended to a jsonl file
    ({"id", "prompt_ids", "answer_ids"}) as soon as each is done, so an interrupted run resumes where it
    stopped. questions: iterable of (id, list of user turns). Up to ``batch_size`` prompts decode together
    (continuous batching: a finished row's place goes at once to the next prompt). ``method``: "ar" (plain
    decoding, the default) or "pld" (prompt lookup): greedy speculative decoding emits exactly what plain
    decoding emits (token for token where the forward's rows are computed independently: float32, GGUF
    precision), only sooner; with several rows the draft length follows hydraspec.adaptive's rule, so
    drafting happens only where the measured cost of a wider verify forward pays for it. The base model's
    last hidden states of each answered sequence go to ``base_cache`` (a trainer.BaseOutputs), taken from
    the decoding forwards, so that training does not run the base model over them again. Returns how many
    were added."""
    if method not in ("ar", "pld"):
        raise HydraspecError(f"data generation decodes with 'ar' or 'pld', not {method!r}")
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
    if not todo:
        return 0
    enc = [(qid, encode_prompt(tokenizer, [{"role": "user", "content": turns[0]}])) for qid, turns in todo]
    capture = base_cache is not None and base_cache.max_bytes > 0
    added = 0
    bar = tqdm(total=len(enc), desc="answering", unit="prompt", disable=not progress)
    with out.open("a") as f:
        def finished(i, res):
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

        bg = BatchGenerator(model, tokenizer, make_drafter(method))  # drafts where the verify forward pays for it
        bg.generate(input_ids=[ids for _, ids in enc], max_new_tokens=max_new_tokens, batch_size=batch_size,
                    keep_hidden=capture, on_result=finished)
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
