"""llama.cpp as a benchmark baseline: `llamacpp-ar`, `llamacpp-draft`, its n-gram speculation types
(`llamacpp-ngram-simple`, `-ngram-mod`, `-ngram-map-k`, `-ngram-map-k4v`, `-ngram-cache`; `llamacpp-ngram` is
ngram-simple) and an n-gram type chained with the draft model (`llamacpp-ngram-simple+draft`,
`llamacpp-ngram-mod+draft`).

Each method runs its own `llama-server` (llama.cpp's HTTP server, built from the sources that the
llama-cpp-python sdist vendors: scripts/build_llamacpp.sh) on the same GGUF files, with the same thread
count, and answers the same token ids as hydraspec's methods through its `/completion` endpoint, greedy
(top-k 1), prompt cache off. The server's own timings give time to first token (prompt_ms) apart from
decoding, and the draft tokens it proposed and had accepted (draft_n, draft_n_accepted; absent when it
drafted nothing). llama.cpp computes in its own arithmetic, so its answers are not expected to equal
hydraspec's token for token; they are compared for speed only.

That llama.cpp speculates only with an explicit `--spec-type` (a comma-separated list; with no type it
infers one only for MTP / EAGLE-3 / DFlash / DSpark drafts, so a plain draft model given with -md alone sits
idle): every speculating method passes its types, a speculating server whose /slots says it cannot
speculate is refused at start, and the report marks a method whose server drafted nothing over the run.
Settings are llama.cpp's defaults (common/common.h): draft model --spec-draft-n-max 3, --spec-draft-n-min 0,
--spec-draft-p-min 0.0 (given explicitly); ngram-simple / ngram-map-k / ngram-map-k4v: lookup n-gram 12,
draft m-gram 48, 1 hit; ngram-mod: match 24, drafts of 48 to 64 tokens; where an n-gram type and a draft
model are both given, the n-gram type drafts first. `--llamacpp-args` appends to the command line (later
flags win).
"""
from __future__ import annotations

import atexit
import json
import os
import shlex
import socket
import subprocess
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

import torch

from ..errors import HydraspecError
from ..models import gguf_file
from .methods import BenchContext, MethodSpec, Runner, TurnResult, register

SERVER = "llama-server"


def binary_dir() -> Path:
    """Where the llama.cpp tools are: $HYDRASPEC_LLAMACPP_BIN, else scripts/build_llamacpp.sh's default."""
    env = os.environ.get("HYDRASPEC_LLAMACPP_BIN")
    if env:
        return Path(env).expanduser()
    home = Path(os.environ.get("HYDRASPEC_HOME") or Path.home() / ".cache" / "hydraspec")
    return home / "llama.cpp" / "build" / "bin"


def tool(name: str) -> Path:
    """One of llama.cpp's built tools (llama-server, llama-perplexity ...), or a HydraspecError saying how to
    build it."""
    path = binary_dir() / name
    if not path.is_file() or not os.access(path, os.X_OK):
        raise HydraspecError(f"llama.cpp's {name} is not at {path}; build it with scripts/build_llamacpp.sh or "
                             "point HYDRASPEC_LLAMACPP_BIN at its directory")
    return path


def server_binary() -> Path:
    return tool(SERVER)


# method kind -> llama.cpp's --spec-type list (empty: no speculation)
SPEC_TYPES: dict[str, tuple[str, ...]] = {
    "ar": (),
    "draft": ("draft-simple",),
    "ngram-simple": ("ngram-simple",),
    "ngram-mod": ("ngram-mod",),
    "ngram-map-k": ("ngram-map-k",),
    "ngram-map-k4v": ("ngram-map-k4v",),
    "ngram-cache": ("ngram-cache",),
    "ngram-simple+draft": ("ngram-simple", "draft-simple"),
    "ngram-mod+draft": ("ngram-mod", "draft-simple"),
}
KIND_ALIASES = {"ngram": "ngram-simple"}  # `llamacpp-ngram`, as before the other n-gram types were added
# llama.cpp's documented defaults for a draft model (common/common.h, common_params_speculative_draft)
DRAFT_DEFAULTS = ("--spec-draft-n-max", "3", "--spec-draft-n-min", "0", "--spec-draft-p-min", "0.0")


def spec_types(kind: str) -> tuple[str, ...]:
    kind = KIND_ALIASES.get(kind, kind)
    if kind not in SPEC_TYPES:
        raise ValueError(kind)
    return SPEC_TYPES[kind]


def uses_draft(kind: str) -> bool:
    return "draft-simple" in spec_types(kind)


def server_command(binary, model: str, threads: int, port: int, kind: str, draft: str | None = None,
                   extra: str | None = None, cache: bool = False) -> list[str]:
    """The llama-server command line of one method kind (see SPEC_TYPES): 'ar' (no speculation), 'draft'
    (--spec-type draft-simple with the draft model and llama.cpp's default draft settings), an n-gram type
    ('ngram-simple', 'ngram-mod', ... at their defaults; 'ngram' = 'ngram-simple'), or an n-gram type
    chained with the draft model ('ngram-mod+draft'). One slot, no prompt cache unless ``cache``, `extra` (a
    shell-quoted string) appended."""
    types = spec_types(kind)
    cmd = [str(binary), "-m", model, "-t", str(threads), "-tb", str(threads), "-c", "8192", "-np", "1",
           *([] if cache else ["--no-cache-prompt"]), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    if "draft-simple" in types:
        if not draft:
            raise HydraspecError(f"method 'llamacpp-{kind}' needs --draft-model")
        cmd += ["-md", draft, "-td", str(threads), "-tbd", str(threads), *DRAFT_DEFAULTS]
    if types:
        cmd += ["--spec-type", ",".join(types)]
    return cmd + shlex.split(extra or "")


def request_body(ids: list[int], max_new_tokens: int, temperature: float, seed: int | None,
                 cache: bool = False) -> dict:
    body = {"prompt": list(map(int, ids)), "n_predict": int(max_new_tokens), "return_tokens": True,
            "cache_prompt": cache, "stream": False, "repeat_penalty": 1.0}
    if temperature > 0:
        body.update(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                    samplers=["temperature", "dist"], seed=-1 if seed is None else int(seed))
    else:
        body.update(temperature=0.0, top_k=1, samplers=["top_k"])
    return body


def turn_result(reply: dict, prompt_tokens: int, wall_s: float, eos: list[int], tokenizer) -> TurnResult:
    """A /completion reply as a TurnResult. An answer that stopped on an end-of-generation token counts
    that token, as the engine does."""
    ids = [int(t) for t in reply.get("tokens") or []]
    finish = "eos" if reply.get("stop_type") == "eos" else "length"
    if finish == "eos" and (not ids or ids[-1] not in eos) and eos:
        ids.append(int(eos[0]))
    timings = reply.get("timings") or {}
    prompt_s = float(timings["prompt_ms"]) / 1000 if "prompt_ms" in timings else None
    drafted, accepted = draft_counts(timings)
    return TurnResult(token_ids=ids, text=tokenizer.decode(ids, skip_special_tokens=True), finish_reason=finish,
                      wall_s=wall_s, prompt_tokens=prompt_tokens, prefill_s=prompt_s, drafted=drafted,
                      draft_accepted=accepted)


def draft_counts(timings: dict) -> tuple[int | None, int | None]:
    """(draft tokens proposed, accepted) from a /completion reply's timings. The server writes draft_n and
    draft_n_accepted only when it drafted something (tools/server/server-common.cpp,
    server_slot_stats::to_json), so timings without them mean 0 drafted; no timings at all: (None, None)."""
    if not timings:
        return None, None
    return int(timings.get("draft_n") or 0), int(timings.get("draft_n_accepted") or 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process: started on a free local port, waited for until /health says ok, stopped
    at close() or interpreter exit. Its output goes to `log`."""

    def __init__(self, cmd_without_port, log: Path, start_timeout: float = 300.0):
        self.port = _free_port()
        cmd = list(cmd_without_port)
        cmd[cmd.index("--port") + 1] = str(self.port)
        self.log = Path(log)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        atexit.register(self.close)
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                self.close()
                raise HydraspecError(f"{SERVER} exited with status {self.proc.returncode} while starting; "
                                     f"see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if json.loads(resp.read()).get("status") == "ok":
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise HydraspecError(f"{SERVER} did not come up within {start_timeout:.0f} s; see {self.log}")
            time.sleep(0.2)

    def slots(self) -> list[dict] | None:
        """The server's /slots (one entry per slot, each with "speculative": whether it can draft), or None
        where the endpoint is off (--no-slots)."""
        try:
            with urllib.request.urlopen(f"{self.url}/slots", timeout=10) as resp:
                data = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None
        return data if isinstance(data, list) else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def complete(self, body: dict, timeout: float = 3600.0) -> dict:
        req = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise HydraspecError(f"{SERVER} answered {e.code}: {e.read()[:300]!r}") from None
        except (urllib.error.URLError, OSError) as e:
            raise HydraspecError(f"{SERVER} failed ({e}); see {self.log}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log_file.closed:
            self._log_file.close()


def check_speculating(name: str, slots: list[dict] | None, log) -> None:
    """Refuse a speculating method whose server cannot speculate (no slot says "speculative": true)."""
    if slots is not None and not any(s.get("speculative") for s in slots if isinstance(s, dict)):
        raise HydraspecError(f"{name}: llama-server started without speculative decoding (its /slots says "
                             f"speculative: false), so it would decode plainly; see {log}")


class LlamaCppRunner(Runner):
    def __init__(self, ctx: BenchContext, kind: str):
        a = ctx.args
        model = str(gguf_file(a.model))
        draft = str(gguf_file(a.draft_model)) if uses_draft(kind) else None
        threads = torch.get_num_threads()  # the bench's own (bench/runner.py sets it)
        self.cache = bool(getattr(a, "prefix_cache", 0))  # its prompt cache where ours runs
        cmd = server_command(server_binary(), model, threads, 0, kind, draft, getattr(a, "llamacpp_args", None),
                             self.cache)
        self.server = LlamaServer(cmd, Path(a.out) / f"llamacpp-{kind}.log")
        if spec_types(kind):
            try:
                check_speculating(f"llamacpp-{kind}", self.server.slots(), self.server.log)
            except HydraspecError:
                self.server.close()
                raise
        self.tok, self.eos = ctx.tokenizer, sorted(ctx.eos)

    def generate(self, ids, max_new_tokens, temperature, seed):
        body = request_body(ids, max_new_tokens, temperature, seed, self.cache)
        t0 = time.perf_counter()
        reply = self.server.complete(body)
        wall = time.perf_counter() - t0
        return turn_result(reply, len(ids), wall, self.eos, self.tok)


_HELP = {
    "ar": "llama.cpp's llama-server on the same GGUF file, plain decoding",
    "draft": "llama.cpp's llama-server with --draft-model's GGUF as draft (--spec-type draft-simple, its "
             "default draft settings)",
    "ngram": "llama.cpp's llama-server with n-gram speculation (--spec-type ngram-simple; = llamacpp-ngram-simple)",
    "ngram-simple+draft": "llama.cpp's llama-server with ngram-simple, else the draft model (--spec-type "
                          "ngram-simple,draft-simple)",
    "ngram-mod+draft": "llama.cpp's llama-server with ngram-mod, else the draft model (--spec-type "
                       "ngram-mod,draft-simple)",
}
for _kind in ("ar", "draft", "ngram", "ngram-simple", "ngram-mod", "ngram-map-k", "ngram-map-k4v", "ngram-cache",
              "ngram-simple+draft", "ngram-mod+draft"):
    _draft = uses_draft(_kind)
    register(MethodSpec(f"llamacpp-{_kind}", partial(LlamaCppRunner, kind=_kind),
                        _HELP.get(_kind, f"llama.cpp's llama-server with n-gram speculation (--spec-type {_kind})"),
                        needs_draft=_draft, settings=("llamacpp_args",) + (("draft_model",) if _draft else ())))
