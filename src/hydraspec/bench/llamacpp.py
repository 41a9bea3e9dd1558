"""llama.cpp as a benchmark baseline: `llamacpp-ar`, `llamacpp-draft` and `llamacpp-ngram`.

Each method runs its own `llama-server` (llama.cpp's HTTP server, built from the sources that the
llama-cpp-python sdist vendors: scripts/build_llamacpp.sh) on the same GGUF files, with the same thread
count, and answers the same token ids as hydraspec's methods through its `/completion` endpoint, greedy
(top-k 1), prompt cache off. The server's own timings give time to first token (prompt_ms) apart from
decoding. llama.cpp computes in its own arithmetic, so its answers are not expected to equal hydraspec's
token for token; they are compared for speed only.
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


def server_command(binary, model: str, threads: int, port: int, kind: str, draft: str | None = None,
                   extra: str | None = None) -> list[str]:
    """The llama-server command line of one method: kind 'ar' (no speculation), 'draft' (draft model,
    llama.cpp's default draft settings) or 'ngram' (--spec-type ngram-simple). One slot, no prompt cache,
    `extra` (a shell-quoted string) appended."""
    cmd = [str(binary), "-m", model, "-t", str(threads), "-tb", str(threads), "-c", "8192", "-np", "1",
           "--no-cache-prompt", "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    if kind == "draft":
        if not draft:
            raise HydraspecError("method 'llamacpp-draft' needs --draft-model")
        cmd += ["-md", draft, "-td", str(threads), "-tbd", str(threads)]
    elif kind == "ngram":
        cmd += ["--spec-type", "ngram-simple"]
    elif kind != "ar":
        raise ValueError(kind)
    return cmd + shlex.split(extra or "")


def request_body(ids: list[int], max_new_tokens: int, temperature: float, seed: int | None) -> dict:
    body = {"prompt": list(map(int, ids)), "n_predict": int(max_new_tokens), "return_tokens": True,
            "cache_prompt": False, "stream": False, "repeat_penalty": 1.0}
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
    return TurnResult(token_ids=ids, text=tokenizer.decode(ids, skip_special_tokens=True), finish_reason=finish,
                      wall_s=wall_s, prompt_tokens=prompt_tokens, prefill_s=prompt_s)


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


class LlamaCppRunner(Runner):
    def __init__(self, ctx: BenchContext, kind: str):
        from ..models import gguf_file

        a = ctx.args
        model = str(gguf_file(a.model))
        draft = str(gguf_file(a.draft_model)) if kind == "draft" else None
        threads = torch.get_num_threads()  # the bench's own (bench/runner.py sets it)
        cmd = server_command(server_binary(), model, threads, 0, kind, draft, getattr(a, "llamacpp_args", None))
        self.server = LlamaServer(cmd, Path(a.out) / f"llamacpp-{kind}.log")
        self.tok, self.eos = ctx.tokenizer, sorted(ctx.eos)

    def generate(self, ids, max_new_tokens, temperature, seed):
        body = request_body(ids, max_new_tokens, temperature, seed)
        t0 = time.perf_counter()
        reply = self.server.complete(body)
        wall = time.perf_counter() - t0
        return turn_result(reply, len(ids), wall, self.eos, self.tok)


for _kind, _help in (("ar", "llama.cpp's llama-server on the same GGUF file, plain decoding"),
                     ("draft", "llama.cpp's llama-server with --draft-model's GGUF as draft (its default settings)"),
                     ("ngram", "llama.cpp's llama-server with n-gram speculation (--spec-type ngram-simple)")):
    register(MethodSpec(f"llamacpp-{_kind}", partial(LlamaCppRunner, kind=_kind), _help,
                        needs_draft=_kind == "draft",
                        settings=("llamacpp_args",) + (("draft_model",) if _kind == "draft" else ())))
