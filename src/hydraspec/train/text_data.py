"""Distillation data read at prefill speed: text the base model reads in one forward pass.

Self-distilled answers cost a decoding step per token. Text that already exists (source files, documents,
conversations) costs one forward over a whole chunk, tens of times cheaper per token on a CPU. Trained with
the base model's own next-token distributions as soft targets (the Hydra++ loss, Ankner et al. 2024), the
heads still learn what the base would say next at each position, not what the text says. Rows use the answers
file's format with an empty prompt, so every position is a target and the base cache holds their states.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from tqdm import tqdm

from ..errors import HydraspecError

TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt")


def text_files(paths) -> list[Path]:
    """The files under ``paths`` (files, or directories walked for :data:`TEXT_SUFFIXES`), sorted."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES and f.is_file())
        elif p.is_file():
            out.append(p)
        else:
            raise HydraspecError(f"--text: no such file or directory: {p}")
    return out


def write_text_rows(tokenizer, paths, out_path, max_tokens: int, seq_len: int = 512, progress: bool = True,
                    seed: int = 0) -> int:
    """Cut the text of ``paths`` into rows of ``seq_len`` tokens, up to ``max_tokens`` tokens in all, and write
    them to ``out_path`` ({"id", "prompt_ids": [], "answer_ids"} per line, the answers file's format). The files
    are read in a fixed shuffled order, so a budget smaller than the text samples all of it. A file already
    holding rows is kept as it is. Returns the number of tokens written (or found)."""
    if seq_len < 8 or max_tokens < seq_len:
        raise HydraspecError(f"text rows need seq_len >= 8 and max_tokens >= seq_len ({seq_len}, {max_tokens})")
    out = Path(out_path)
    if out.exists() and out.stat().st_size:
        return sum(len(json.loads(line)["answer_ids"]) for line in out.read_text().splitlines() if line.strip())
    files = text_files(paths)
    random.Random(seed).shuffle(files)
    if not files:
        raise HydraspecError(f"--text: no {', '.join(TEXT_SUFFIXES)} files under {', '.join(map(str, paths))}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    written = 0
    bar = tqdm(total=max_tokens, desc="reading text", unit="tok", disable=not progress)
    with tmp.open("w") as f:
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            for i in range(0, len(ids) - seq_len // 4, seq_len):  # a short tail is left out
                chunk = ids[i: i + seq_len][: max_tokens - written]
                f.write(json.dumps({"id": f"text-{path}-{i}", "prompt_ids": [], "answer_ids": chunk}) + "\n")
                written += len(chunk)
                bar.update(len(chunk))
                if written >= max_tokens:
                    break
            if written >= max_tokens:
                break
    bar.close()
    tmp.replace(out)
    return written
