"""The thread that owns the engine: it takes requests and cancellations from an inbox at step boundaries,
runs the engine's steps while there is work and hands each request's tokens to the caller's callbacks."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..engine import Engine, Request, cancelled_result
from ..frame_room import call_with_room

log = logging.getLogger("hydraspec.serve")


class QueueFull(Exception):
    """More requests are waiting than the server's --max-queue."""


@dataclass
class Counters:
    """What /metrics reports, updated by the worker thread."""

    steps: int = 0
    tokens: int = 0
    row_forwards: int = 0  # one per row per step
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (time, tokens) per step

    def tokens_per_s(self, window: float = 10.0) -> float:
        now = time.monotonic()
        pts = [(t, n) for t, n in self.recent if now - t <= window]
        if not pts:
            return 0.0
        span = max(now - pts[0][0], 1e-3)
        return sum(n for _, n in pts) / span


class EngineWorker:
    """Runs ``engine``: ``start()`` in a daemon thread, or ``run()`` in the calling thread (the CLI runs it in
    the main thread); either way the loop runs with room on the frame stack (hydraspec.frame_room).
    ``submit(request, on_event)``: on_event(kind, payload) is called from the engine's thread with
    ("tokens", ids) after each step and ("done", result) once. ``keep``: where finished answers go (a
    hydraspec.serve.kept_answers.KeptAnswers), or None. ``learner``: what learns from them while no request
    runs or waits (a hydraspec.serve.learn.HeadLearner: kept answers are handed to its ``add``, and its
    ``work()`` is called, one unit at a time, between looks at the inbox), or None."""

    def __init__(self, engine: Engine, max_queue: int, keep=None, learner=None):
        self.engine = engine
        self.max_queue = max_queue
        self.keep = keep
        self.learner = learner
        self.inbox: queue.Queue = queue.Queue()
        self.counters = Counters()
        self.lock = threading.Lock()
        self.outstanding = 0  # submitted and not finished
        self.events: dict[int, Callable] = {}
        self.stopping = False
        self.step_tokens = 0
        self.on_step: Callable[[float], None] | None = None  # called with each verify step's seconds
        self.thread = threading.Thread(target=call_with_room, args=(self._loop,), name="hydraspec-engine",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def run(self) -> None:
        """The engine loop in this thread, until stop(); on Ctrl-C every request still open is cancelled."""
        try:
            call_with_room(self._loop)
        except BaseException:
            with self.lock:
                self.stopping = True
            self._abort_all()
            raise

    @property
    def running_rows(self) -> int:
        return len(self.engine.active)

    @property
    def queue_length(self) -> int:
        """Requests submitted and not yet decoding."""
        with self.lock:
            return max(0, self.outstanding - len(self.engine.active))

    def submit(self, req: Request, on_event: Callable) -> None:
        with self.lock:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            if self.outstanding >= self.engine.rows + self.max_queue:  # every row busy and the queue full
                raise QueueFull(f"{self.max_queue} requests are already waiting (--max-queue)")
            self.outstanding += 1
            self.events[id(req)] = on_event
        req.on_tokens = self._tokens
        self.inbox.put(("add", req))

    def cancel(self, req: Request) -> None:
        self.inbox.put(("cancel", req))

    def forget(self) -> None:
        """At the next step boundary, the engine drops what earlier requests left (Engine.forget)."""
        self.inbox.put(("forget", None))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel every running and waiting request, then end the thread."""
        with self.lock:
            self.stopping = True
        self.inbox.put(("stop", None))
        if self.thread.is_alive():
            self.thread.join(timeout)

    def _tokens(self, req: Request, ids: list[int]) -> None:
        self.step_tokens += len(ids)
        fn = self.events.get(id(req))
        if fn is not None:
            fn("tokens", ids)

    def _finish(self, req: Request) -> None:
        with self.lock:
            self.outstanding -= 1
            fn = self.events.pop(id(req), None)
        self._keep(req.result)
        if fn is not None:
            fn("done", req.result)

    def _keep(self, result) -> None:
        """A finished answer to the kept answers; a failing disk stops the keeping, never the serving."""
        if self.keep is None or result is None or result.finish_reason == "cancelled":
            return
        try:
            row = self.keep.add(result.prompt_ids, result.token_ids)
        except OSError as e:
            log.error("answers are no longer kept (%s): %s", self.keep.path, e)
            self.keep = None
            return
        if row is not None and self.learner is not None:
            self.learner.add(row, hidden=result.hidden_states)

    def _learn(self) -> bool:
        """One unit of the learner's work while idle; False when it has none (a failing learner stops, not the
        server)."""
        if self.learner is None or self.engine.busy or not self.inbox.empty():
            return False
        try:
            return self.learner.work()
        except Exception:
            log.exception("the heads stop learning")
            self.learner = None
            return False

    def _drain_adds(self) -> list[Request]:
        """Empty the inbox; the requests it still held."""
        out = []
        while True:
            try:
                kind, req = self.inbox.get_nowait()
            except queue.Empty:
                return out
            if kind == "add":
                out.append(req)

    def _abort_all(self) -> None:
        """Tell every open request it was cancelled (after an interrupted step: the engine is not reused)."""
        for req in [r.req for r in self.engine.active] + list(self.engine.waiting) + self._drain_adds():
            if req.result is None:
                req.result = cancelled_result(req)
            self._finish(req)

    def _take(self, block: bool) -> bool:
        """Move the inbox into the engine; False when asked to stop."""
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, req = item
            if kind == "stop":
                return False
            if kind == "add":
                try:
                    self.engine.add(req)
                except Exception as exc:  # checked by the handler first; never lose a request silently
                    log.error("request refused by the engine: %s", exc)
                    req.result = None
                    self._finish(req)
            elif kind == "forget":
                self.engine.forget()
            else:
                self.engine.cancel(req)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _loop(self) -> None:
        eng = self.engine
        while True:
            learning = self._learn()
            if not self._take(block=not eng.busy and not learning):
                break
            if not eng.busy:
                continue
            before, self.step_tokens = eng.forwards, 0
            try:
                done = eng.step()
            except Exception:  # a failing step must not hang the clients: cancel what is running
                log.exception("engine step failed")
                for r in list(eng.active):
                    eng.cancel(r.req)
                for q in eng.waiting:
                    eng.cancel(q)
                done = eng.step()
            if eng.forwards > before:
                c = self.counters
                c.steps += 1
                if self.on_step is not None:
                    self.on_step(eng.last_verify_s)
                c.row_forwards += eng.last_rows
                c.tokens += self.step_tokens
                c.recent.append((time.monotonic(), self.step_tokens))
            for req in done:
                self._finish(req)
        # shutting down: cancel everything still here and tell its callers
        for req in self._drain_adds():
            eng.waiting.append(req)
        for r in list(eng.active):
            eng.cancel(r.req)
        for q in list(eng.waiting):
            eng.cancel(q)
        for req in eng.step():
            self._finish(req)
