"""Model, tokenizer and drafter from command-line options: the one place every command (generate, serve,
build-tree, train-heads) loads the target and the draft model and builds the drafter its --method names."""
from __future__ import annotations

import torch

from . import models
from .drafters import DRAFT_METHODS, HEAD_METHODS, auto_heads, check_method, make_auto, make_drafter
from .drafters.hybrid import LookupHybridDrafter
from .drafters.prompt_lookup import PromptLookupDrafter
from .errors import HydraspecError
from .heads import ensure_heads, load_heads, read_features
from .inputs import eos_ids
from .options import draft_k_option, leaves_option, shipped_tree_for, suffix_store_for, thread_count
from .tree import load_tree_spec

__all__ = ["check_args_method", "load_models", "load_stack", "build_drafter", "is_dynamic", "dynamic_options"]


def check_args_method(args) -> None:
    """Refuse a --method that does not exist or lacks what it needs (--draft-model, --heads), before anything
    is loaded."""
    check_method(args.method, has_draft=bool(args.draft_model), has_heads=bool(getattr(args, "heads", None)))


def load_models(args, draft: bool = False, threads: int | None = None, progress: bool = True):
    """The target as --model, --dtype, --device and --quant ask, and with ``draft`` the draft model as
    --draft-model, --draft-quant and --draft-vocab ask (sharing the target's tokenizer where it is the same),
    computing on ``threads`` (default :func:`~hydraspec.options.thread_count`); returns ``(model, tokenizer,
    (draft model, draft tokenizer) or None)``. Nothing is compiled here."""
    torch.set_num_threads(threads or thread_count())
    model, tok = models.load_model(args.model, dtype=args.dtype, device=args.device, quant=args.quant,
                                   progress=progress)
    pair = models.load_draft_model(args.draft_model, args.dtype, args.device, getattr(args, "draft_quant", None),
                                   vocab=getattr(args, "draft_vocab", None), tokenizer=tok) if draft else None
    return model, tok, pair


def load_stack(args, threads: int | None = None):
    """Model, tokenizer and drafter for a command's --model, --draft-model, --heads and --method: loaded,
    compiled as --compile asks (both models loaded first: peak memory), the drafter built."""
    check_args_method(args)
    wants_draft = args.method in DRAFT_METHODS or (args.method == "auto" and args.draft_model)
    model, tok, draft = load_models(args, draft=bool(wants_draft), threads=threads)
    if getattr(args, "learn", None):  # serve --learn: fresh heads the first time
        ensure_heads(args.heads, model, args.learn_kind, args.model, eos_ids(model, tok))
    heads = args.method.removeprefix("pld+") in HEAD_METHODS or (args.method == "auto" and getattr(args, "heads", None))
    if heads and getattr(args, "heads", None):
        read_features(args.heads, model)
    models.compile_models(model, draft[0] if draft else None, how=args.compile, hidden=bool(heads))
    return model, tok, build_drafter(args, tok, draft, model)


def build_drafter(args, target_tok, draft=None, model=None):
    """The drafter --method names, from the loaded target (``model``, its tokenizer) and draft model (``draft``:
    (model, tokenizer) or None), shaped by the drafter options (make_drafter does the mapping)."""
    method = args.method
    check_method(method, has_heads=bool(args.heads) if method.removeprefix("pld+") in HEAD_METHODS else None)
    if method.removeprefix("pld+") in HEAD_METHODS:
        return _heads_drafter(args, model)
    if method == "pld":
        return make_drafter("pld", num_tokens=args.pld_tokens, max_ngram=args.pld_ngram,
                            min_ngram=args.pld_min_ngram)
    if method == "auto":
        return _auto_drafter(args, target_tok, draft, model)
    if method == "pld+draft":
        lookup = PromptLookupDrafter(num_tokens=args.pld_tokens, max_ngram=args.pld_ngram, min_ngram=args.pld_min_ngram)
        return LookupHybridDrafter(_draft_drafter(args, target_tok, draft, method), lookup, prefer_lookup=True)
    if method == "draft":
        return _draft_drafter(args, target_tok, draft, method)
    if method == "suffix":
        return make_drafter("suffix", store=suffix_store_for(args))
    return make_drafter(method)  # ar


def _heads_drafter(args, model):
    """medusa, hydra, hydra++, eagle and their pld+ forms: the heads of --heads with --tree (or their default)."""
    method = args.method
    heads, cfg = load_heads(args.heads, model, base_model=args.model, drafting=True)
    lookup = {}
    if method.startswith("pld+"):
        lookup = dict(pld_tokens=args.pld_tokens, pld_ngram=args.pld_ngram, pld_min_ngram=args.pld_min_ngram)
    if is_dynamic(args):
        return make_drafter(method, heads=heads, embed=model.get_input_embeddings(), **dynamic_options(args), **lookup)
    tree = load_tree_spec(args.tree, max_depth=heads.num_heads) if args.tree else cfg.get("default_tree")
    if heads.method == "eagle":
        lookup["min_prob"] = args.min_prob if args.min_prob is not None else cfg.get("min_prob")
    return make_drafter(method, heads=heads, embed=model.get_input_embeddings(), tree=tree, **lookup)


def _auto_drafter(args, target_tok, draft, model):
    """Prompt lookup, suffix decoding and predictions, plus the draft model and heads where given."""
    more = {}
    if draft is not None:
        more["draft"] = _draft_drafter(args, target_tok, draft, "auto")
    if getattr(args, "heads", None):
        heads, cfg = load_heads(args.heads, model, base_model=args.model, drafting=True)
        more.update(auto_heads(heads, cfg, model.get_input_embeddings()))
    return make_auto(model, more, pld_tokens=args.pld_tokens, pld_ngram=args.pld_ngram,
                     pld_min_ngram=args.pld_min_ngram, store=suffix_store_for(args))


def _draft_drafter(args, target_tok, draft, method: str):
    """The draft model's drafter as the draft options ask (the pair's shipped tree when none do)."""
    if draft is None:
        raise HydraspecError(f"method '{method}' needs --draft-model")
    widths = _widths(args.draft_tree) if args.draft_tree else None
    dm, dtok = draft
    pair = dict(draft_model=dm, target_tokenizer=target_tok, draft_tokenizer=dtok)
    if getattr(args, "tree", None):
        if widths:
            raise HydraspecError("give either --draft-tree or --tree, not both")
        leaves_option(args)
        if is_dynamic(args):
            return make_drafter("draft", **pair, **dynamic_options(args))
        return make_drafter("draft", **pair, tree=args.tree, confidence=args.draft_confidence)  # a tree.json brings its stop
    shipped = shipped_tree_for(args)
    if shipped is not None:
        return make_drafter("draft", **pair, tree=shipped)
    return make_drafter("draft", **pair, dynamic=not args.no_dynamic, widths=widths, confidence=args.draft_confidence,
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
