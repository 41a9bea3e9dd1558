"""A server's own answers, kept as self-distillation data (`hydraspec serve --keep-answers DIR`).

Every answer the server finishes is the base model's own output for a real prompt: what Medusa, Hydra++ and
EAGLE heads distil from, at no extra decoding cost. Each finished request (cancelled ones and empty answers
left out) is appended to DIR/answers.jsonl as one line {"id", "prompt_ids", "answer_ids"}: the format
`hydraspec train-heads --data` reads, so the server's traffic trains heads for the model it serves. The file
holds at most ``max_tokens`` prompt and answer tokens: past that, the oldest lines are dropped (the file is
rewritten to 90 % of the bound, through a temporary file, so an interrupted rewrite loses nothing). A
restart reads the file back and goes on numbering where it stopped. Only token ids are stored, no text.
"""
from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path

from ..errors import HydraspecError

FILE = "answers.jsonl"
PREFIX = "served-"


class KeptAnswers:
    """Appends finished answers to ``directory``/answers.jsonl, at most ``max_tokens`` tokens in all."""

    def __init__(self, directory, max_tokens: int = 2_000_000):
        if max_tokens < 1:
            raise HydraspecError(f"--keep-answers-tokens must be at least 1, got {max_tokens}")
        self.path = Path(directory) / FILE
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise HydraspecError(f"cannot keep answers in {directory}: {e.strerror or e}") from None
        self.max_tokens = max_tokens
        self.lines: deque[tuple[int, str]] = deque()  # (tokens, the line as written)
        self.tokens = 0
        self.next = 0
        if self.path.exists():
            self._read_back()

    def _read_back(self) -> None:
        text = self.path.read_text()
        clean = not text or text.endswith("\n")
        for line in text.splitlines():
            try:
                row = json.loads(line)
                n = len(row["prompt_ids"]) + len(row["answer_ids"])
            except (json.JSONDecodeError, KeyError, TypeError):
                clean = False  # a line cut off by a crash: the file is written again without it
                continue
            self.lines.append((n, line))
            self.tokens += n
            rid = str(row.get("id", ""))
            if rid.startswith(PREFIX) and rid[len(PREFIX):].isdigit():
                self.next = max(self.next, int(rid[len(PREFIX):]) + 1)
        if self.tokens > self.max_tokens or not clean:
            self._drop_oldest()

    def add(self, prompt_ids: list[int], answer_ids: list[int]) -> dict | None:
        """Keep one finished answer (nothing for an empty one); the row as kept."""
        if not answer_ids:
            return None
        row = {"id": f"{PREFIX}{self.next}", "prompt_ids": list(prompt_ids), "answer_ids": list(answer_ids)}
        line = json.dumps(row)
        self.next += 1
        n = len(prompt_ids) + len(answer_ids)
        with self.path.open("a") as f:
            f.write(line + "\n")
        self.lines.append((n, line))
        self.tokens += n
        if self.tokens > self.max_tokens:
            self._drop_oldest()
        return row

    def _drop_oldest(self) -> None:
        """Drop the oldest lines down to 90 % of the bound and rewrite the file."""
        while self.lines and self.tokens > 0.9 * self.max_tokens:
            n, _ = self.lines.popleft()
            self.tokens -= n
        tmp = self.path.with_name(f"{FILE}.{os.getpid()}.tmp")
        tmp.write_text("".join(line + "\n" for _, line in self.lines))
        tmp.replace(self.path)
