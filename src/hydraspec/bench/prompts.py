"""Benchmark prompt files in the Spec-Bench / MT-Bench format.

One JSON object a line: {"question_id": ..., "category": ..., "turns": ["user turn 1", ...]}, optionally
"prediction": a text the first answer is expected to mostly repeat (OpenAI's predicted outputs); other keys
(e.g. "reference") are ignored and blank lines are skipped. A missing or empty category becomes the
file's stem; a missing question_id becomes the question's 0-based position in its file. question_id
must be unique within a file; when several files are combined every id is prefixed with its file's
stem ("<stem>-<id>") so ids stay unique across files.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import HydraspecError


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]
    source: str  # the file's stem
    prediction: str | None = None  # text the first answer is expected to mostly repeat (predicted outputs)


def load_prompt_file(path: str | Path) -> list[Question]:
    """Parse one prompt file; HydraspecError names the file and the 1-based line of any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise HydraspecError(f"cannot read prompt file '{path}': {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise HydraspecError(f"prompt file '{path}' is not UTF-8 text") from None
    stem = path.stem
    out: list[Question] = []
    seen: dict[int | str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise HydraspecError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise HydraspecError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        turns = obj.get("turns")
        if turns is None:
            raise HydraspecError(f"{where}: missing 'turns'")
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise HydraspecError(f"{where}: 'turns' must be a list of strings")
        if not turns:
            raise HydraspecError(f"{where}: 'turns' is empty")
        qid = obj.get("question_id", len(out))
        if isinstance(qid, bool) or not isinstance(qid, (int, str)):
            raise HydraspecError(f"{where}: 'question_id' must be an integer or a string")
        if qid in seen:
            raise HydraspecError(f"{where}: duplicate question_id {qid!r} (first on line {seen[qid]})")
        seen[qid] = lineno
        category = obj.get("category")
        if category is not None and not isinstance(category, str):
            raise HydraspecError(f"{where}: 'category' must be a string")
        prediction = obj.get("prediction")
        if prediction is not None and not isinstance(prediction, str):
            raise HydraspecError(f"{where}: 'prediction' must be a string")
        out.append(Question(qid, category or stem, tuple(turns), stem, prediction))
    return out


def load_questions(paths, limit: int | None = None, categories=None, skip: int = 0) -> list[Question]:
    """All questions of `paths` (in file order), then the `categories` filter, then `skip` and `limit`:
    the first `skip` questions of each category are dropped (e.g. kept for evaluation) and the next
    `limit` kept. Deterministic."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise HydraspecError("no prompt files given")
    if limit is not None and limit < 1:
        raise HydraspecError(f"--limit must be at least 1, got {limit}")
    combine = len(paths) > 1
    stems: dict[str, Path] = {}
    questions: list[Question] = []
    for p in paths:
        qs = load_prompt_file(p)
        if combine:
            if p.stem in stems:
                raise HydraspecError(f"prompt files '{stems[p.stem]}' and '{p}' have the same name '{p.stem}'; "
                                     "question ids are prefixed with the file name, so names must differ")
            stems[p.stem] = p
            qs = [Question(f"{q.source}-{q.question_id}", q.category, q.turns, q.source, q.prediction) for q in qs]
        questions.extend(qs)
    if categories:
        wanted = list(dict.fromkeys(categories))
        known = list(dict.fromkeys(q.category for q in questions))
        missing = [c for c in wanted if c not in known]
        if missing:
            raise HydraspecError(f"no questions in categor{'y' if len(missing) == 1 else 'ies'} "
                                 f"{', '.join(missing)}; known: {', '.join(known)}")
        questions = [q for q in questions if q.category in wanted]
    if skip < 0:
        raise HydraspecError(f"--skip must be at least 0, got {skip}")
    if skip:
        seen: dict[str, int] = {}
        kept = []
        for q in questions:
            seen[q.category] = seen.get(q.category, 0) + 1
            if seen[q.category] > skip:
                kept.append(q)
        questions = kept
    if limit is not None:
        taken: dict[str, int] = {}
        kept = []
        for q in questions:
            if taken.get(q.category, 0) < limit:
                taken[q.category] = taken.get(q.category, 0) + 1
                kept.append(q)
        questions = kept
    if not questions:
        raise HydraspecError("the prompt files hold no questions")
    return questions
