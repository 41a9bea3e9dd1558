from __future__ import annotations

from ..backend import rows_per_pass
from ..errors import HydraspecError
from ..heads.checkpoint import default_tree
from ..verify_cost import SIZES, measure_verify_cost
from .auto import AutoDrafter
from .base import Drafter, NoDrafter
from .draft_model import DraftModelDrafter, check_vocab
from .dynamic import DynamicDraftModelDrafter, DynamicHeadDrafter, parse_dynamic
from .eagle import FOLLOW_TREE, EagleDrafter
from .heads import HeadDrafter
from .hybrid import LookupHybridDrafter
from .prediction import PredictionDrafter
from .prompt_lookup import PromptLookupDrafter
from .suffix import SuffixDrafter


def make_auto(target, costly: dict[str, Drafter] | None = None, pld_tokens: int = 10, pld_ngram: int = 3,
              pld_min_ngram: int = 2, cost: dict[int, float] | None = None,
              store: list[list[int]] | None = None) -> Drafter:
    """The ``auto`` method: prompt lookup, suffix decoding and predicted outputs always, plus ``costly``
    drafters (a draft model, heads), chosen per sequence and step by measured payoff (drafters.auto).
    ``target``: the model whose verify cost is measured now (once per process and machine: a server pays for it
    at start-up, not under its first request), after its steps are compiled, and kept current by the steps'
    own times; ``cost``: those points ({tokens: seconds}) where already known (then ``target`` is not used,
    and the points are kept as given); ``store``: answers suffix decoding
    drafts from beside earlier ones (SuffixDrafter's)."""
    subs: dict[str, Drafter] = {
        "pld": PromptLookupDrafter(num_tokens=pld_tokens, max_ngram=pld_ngram, min_ngram=pld_min_ngram, dynamic=False),
        "suffix": SuffixDrafter(store=store), "prediction": PredictionDrafter()}
    subs.update(costly or {})
    return AutoDrafter(subs, cost if cost is not None else measure_verify_cost(target, sizes=SIZES),
                       rows_per_pass(target) if target is not None else None, learn=cost is None)


def auto_heads(heads, cfg: dict, embed) -> dict[str, Drafter]:
    """Loaded heads as ``auto`` takes them ({name: drafter}, for make_auto's ``costly``): an EAGLE head follows
    every step with one node (drafters.eagle.FOLLOW_TREE), other kinds draft their default tree when chosen."""
    opts = {"tree": FOLLOW_TREE, "follow": True} if heads.method == "eagle" else {"tree": cfg.get("default_tree")}
    return {heads.kind: make_drafter(heads.method, heads=heads, embed=embed, **opts)}


METHODS = ("ar", "auto", "draft", "pld", "suffix", "medusa", "hydra", "hydra++", "eagle", "pld+draft", "pld+medusa",
           "pld+hydra", "pld+hydra++", "pld+eagle")
HEAD_METHODS = ("medusa", "hydra", "hydra++", "eagle")
DRAFT_METHODS = ("draft", "pld+draft")  # the methods that need a draft model


def check_method(method: str, has_draft: bool | None = None, has_heads: bool | None = None) -> None:
    """Refuse a method name that does not exist, or a method without what it needs (``has_draft``: whether a
    draft model is given, ``has_heads``: whether heads are; None: not checked), before anything is loaded.
    make_drafter and the command line share it."""
    if method not in METHODS:
        raise HydraspecError(f"unknown method '{method}'; known: {', '.join(METHODS)}")
    if has_draft is False and method in DRAFT_METHODS:
        raise HydraspecError(f"method '{method}' needs --draft-model")
    if has_heads is False and method.removeprefix("pld+") in HEAD_METHODS:
        raise HydraspecError(f"method '{method}' needs --heads DIR")


def make_drafter(method: str, draft_model=None, target_tokenizer=None, draft_tokenizer=None,
                 **options) -> Drafter:
    """Build the drafter for a method name: 'ar' (none), 'draft' (needs draft_model), 'pld', 'medusa' /
    'hydra' / 'hydra++' / 'eagle' (heads=, embed=); 'pld+medusa' / 'pld+hydra' / 'pld+hydra++' / 'pld+eagle': prompt lookup merged
    into the heads' tree (pld_tokens=, pld_ngram=, pld_min_ngram= for the lookup); 'pld+draft': prompt lookup's
    chain where it finds one, else the draft model's proposal (the draft model is not run that step).

    tree= (draft, medusa, hydra): a list of rank paths, a tree.json file / its dict (from `hydraspec
    build-tree`), or "dynamic" for a dynamic tree of tree_nodes nodes, tree_depth levels and tree_topk
    children per expanded node."""
    check_method(method)
    if method.startswith("pld+"):
        lk = {k: options.pop(f"pld_{k}") for k in ("tokens", "ngram", "min_ngram") if options.get(f"pld_{k}") is not None}
        for k in ("pld_tokens", "pld_ngram", "pld_min_ngram"):
            options.pop(k, None)
        lookup = PromptLookupDrafter(num_tokens=lk.get("tokens", 10), max_ngram=lk.get("ngram", 3),
                                     min_ngram=lk.get("min_ngram", 2))
        inner = make_drafter(method[4:], draft_model, target_tokenizer, draft_tokenizer, **options)
        return LookupHybridDrafter(inner, lookup, prefer_lookup=method == "pld+draft")
    tree = options.pop("tree", None)
    dyn = {k: options.pop(k) for k in ("tree_nodes", "tree_depth", "tree_topk") if options.get(k) is not None}
    dyn = {k.removeprefix("tree_"): v for k, v in dyn.items()}
    for k in ("tree_nodes", "tree_depth", "tree_topk"):
        options.pop(k, None)
    if method == "ar":
        return NoDrafter()
    if method == "pld":
        return PromptLookupDrafter(**options)
    if method == "suffix":
        return SuffixDrafter(**options)
    if method == "draft":
        if draft_model is None:
            raise HydraspecError("method 'draft' needs a draft model (--draft-model)")
        if target_tokenizer is not None and draft_tokenizer is not None:
            check_vocab(target_tokenizer, draft_tokenizer)
        if parse_dynamic(tree):
            return DynamicDraftModelDrafter(draft_model, **dyn)
        if tree is not None:
            options["tree"] = tree
        return DraftModelDrafter(draft_model, **options)
    if method in HEAD_METHODS:
        heads, embed = options.get("heads"), options.get("embed")
        if heads is None or embed is None:
            raise HydraspecError(f"method '{method}' needs trained heads (--heads DIR)")
        has_prefix = getattr(heads, "prefix", None) is not None
        if method == "hydra++" and not (heads.kind == "hydra" and has_prefix):
            raise HydraspecError(f"method 'hydra++' needs Hydra++ heads (train-heads --kind hydra++), not {heads.kind} heads"
                                 f"{' without a prefix layer' if heads.kind == 'hydra' else ''}")
        if heads.method != method.rstrip("+"):
            raise HydraspecError(f"--heads holds {heads.kind} heads, not {method} heads")
        if heads.method == "eagle":
            if parse_dynamic(tree):
                raise HydraspecError("EAGLE heads draft static trees (--tree FILE or the heads' default), not 'dynamic'")
            return EagleDrafter(heads, embed, tree or default_tree(heads.num_heads),
                                **{k: options[k] for k in ("min_prob", "follow") if options.get(k) is not None})
        if parse_dynamic(tree):
            return DynamicHeadDrafter(heads, embed, **dyn)
        return HeadDrafter(heads, embed, tree or default_tree(heads.num_heads))
    raise HydraspecError(f"unknown method '{method}'; known: {', '.join(METHODS)}")  # (a method without a branch)
