"""<out>/records.jsonl: the run's settings on the first line, then one finished (method, question) record
a line, each appended and flushed as soon as it finishes, so an interrupted run loses at most the pairs in
flight and a rerun with the same --out skips what is there."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import HydraspecError

FORMAT = 1
# settings that must match for a rerun to add to an --out directory; seed only matters when sampling
CORE_KEYS = ("model", "dtype", "device", "max_new_tokens", "temperature", "seed", "turns")


def _norm(x):
    return json.loads(json.dumps(x))


def core_mismatch(old: dict, new: dict) -> list[str]:
    keys = [k for k in CORE_KEYS if k != "seed" or (new.get("temperature") or 0) > 0]
    return [f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in keys if _norm(old.get(k)) != _norm(new.get(k))]


class RecordStore:
    def __init__(self, path: str | Path, settings: dict):
        self.path = Path(path)
        self.settings = _norm(settings)
        self.records: list[dict] = []
        self._load()

    def _load(self) -> None:
        p = self.path
        if not p.exists() or p.stat().st_size == 0:
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p, "w", encoding="utf-8") as f:
                f.write(json.dumps({"hydraspec_bench": FORMAT, "settings": self.settings}) + "\n")
            return
        raw = p.read_bytes()
        if not raw.endswith(b"\n"):  # a record cut off by an interrupt: drop the partial line
            cut = raw.rfind(b"\n") + 1
            with open(p, "r+b") as f:
                f.truncate(cut)
            raw = raw[:cut]
        lines = raw.decode("utf-8").splitlines()
        where = f"{p}"
        try:
            head = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError:
            head = {}
        if not isinstance(head, dict) or "hydraspec_bench" not in head:
            raise HydraspecError(f"{where} does not start with hydraspec bench settings; use a fresh --out directory")
        diff = core_mismatch(head.get("settings", {}), self.settings)
        if diff:
            raise HydraspecError(f"--out {p.parent} holds a run with different settings ({'; '.join(diff)}); "
                                 "use a fresh --out directory or rerun with the same settings to resume")
        for i, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise HydraspecError(f"{where}, line {i}: not valid JSON ({e.msg}); "
                                     "fix or delete that line, or use a fresh --out directory") from None
            self.records.append(rec)

    def done(self) -> set:
        return {(r["method"], r["question_id"]) for r in self.records}

    def check_methods(self, current: dict) -> None:
        """current: method -> its settings now. Refuse to mix records made with other method settings."""
        for r in self.records:
            m = r["method"]
            if m in current and _norm(r.get("settings", {})) != _norm(current[m]):
                raise HydraspecError(
                    f"--out {self.path.parent} holds '{m}' answers made with {r.get('settings')}, this run has "
                    f"{current[m]}; use a fresh --out directory or the same settings to resume")

    def append(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.records.append(record)
