"""The methods a benchmark can run, in one registry.

METHODS maps a name to a MethodSpec whose `factory(ctx)` builds a Runner for the loaded models; a
Runner answers one prompt (token ids) and reports a TurnResult. A new method (e.g. 'medusa', 'hydra',
'hydra++' with `needs_heads=True`) is one `register(MethodSpec(...))` call.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..drafters import DRAFT_METHODS, auto_heads, make_auto, make_drafter
from ..drafters.hybrid import LookupHybridDrafter
from ..drafters.prompt_lookup import PromptLookupDrafter
from ..errors import HydraspecError
from ..generator import SpeculativeGenerator
from ..heads import load_heads
from ..options import draft_k_option, leaves_option, shipped_tree_for, suffix_store_for
from ..prefix_pool import PrefixPool
from ..tree import load_tree_spec


@dataclass
class TurnResult:
    token_ids: list[int]  # new tokens; an EOS that ended the answer included
    text: str
    finish_reason: str  # "eos" | "length"
    wall_s: float
    prompt_tokens: int
    target_forwards: int | None = None  # None: the method does not expose it
    mean_accepted: float | None = None
    accept_hist: list[int] | None = None  # index = tokens emitted per target forward
    prefill_s: float | None = None
    draft_s: float | None = None
    verify_s: float | None = None
    accept_s: float | None = None
    drafted: int | None = None  # draft tokens proposed (llama.cpp's server reports them); None: not reported
    draft_accepted: int | None = None  # of those, accepted by the target
    cached_tokens: int | None = None  # prompt tokens taken from a prefix cache (--prefix-cache)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["new_tokens"] = self.new_tokens
        return d


@dataclass
class BenchContext:
    """What a method factory may use. draft: (model, tokenizer) of --draft-model or None."""

    model: object
    tokenizer: object
    args: object
    draft: tuple | None = None
    heads: list[str] | str | None = None
    eos: list[int] = field(default_factory=list)


class Runner:
    def generate(self, ids: list[int], max_new_tokens: int, temperature: float, seed: int | None) -> TurnResult:
        raise NotImplementedError


@dataclass(frozen=True)
class MethodSpec:
    name: str
    factory: Callable[[BenchContext], Runner]
    help: str = ""
    needs_draft: bool = False
    needs_heads: bool = False
    settings: tuple[str, ...] = ()  # args attributes that change this method's answers or speed
    tree: str | None = None  # a 'NAME@TREE' variant: its own --tree ('default': the drafter's own)
    takes_draft: bool = False  # uses --draft-model where one is given
    takes_heads: bool = False  # uses --heads where given
    predicts: bool = False  # its runner takes a question's prediction (predicted outputs)


METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    METHODS[spec.name] = spec
    return spec


def variant_args(base_name: str, tree: str) -> dict | None:
    """The args a 'NAME@TREE' variant sets: its --tree ('default': none, the drafter's own), or for
    'draft@leaves=N' the draft chain with --draft-leaves N; None when TREE is not valid for NAME."""
    if tree.startswith("leaves="):
        n = tree.removeprefix("leaves=")
        return {"tree": None, "draft_leaves": int(n)} if base_name == "draft" and n.isdigit() else None
    return {"tree": None if tree == "default" else tree}


def tree_variant(name: str) -> MethodSpec | None:
    """'NAME@TREE' -> a registered variant of method NAME that uses its own tree (a tree.json file,
    'dynamic' with the --tree-nodes/--tree-depth sizes, or 'default': the heads' default tree or the
    draft model's chain), so that several trees can be compared in one bench run; None when NAME
    takes no tree. 'draft@leaves=N': the draft model's chain with N runner-up leaves
    (--draft-leaves N)."""
    base_name, _, tree = name.partition("@")
    base = METHODS.get(base_name)
    if base is None or not tree or "tree" not in base.settings or base.tree is not None:
        return None
    overrides = variant_args(base_name, tree)
    if overrides is None:
        return None
    if name not in METHODS:
        def factory(ctx: BenchContext, base=base) -> Runner:
            args = copy.copy(ctx.args)
            for k, v in overrides.items():
                setattr(args, k, v)
            return base.factory(dataclasses.replace(ctx, args=args))

        register(MethodSpec(name, factory, f"{base.help}; tree {tree}", base.needs_draft, base.needs_heads,
                            base.settings, tree))
    return METHODS[name]


def parse_methods(text) -> list[str]:
    """'ar,pld' (or a list) -> known method names, duplicates dropped, order kept. A method that takes a
    tree may be given as NAME@TREE (see :func:`tree_variant`)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    names = list(dict.fromkeys(s.strip() for s in items if s and s.strip()))
    if not names:
        raise HydraspecError(f"no methods given; known: {', '.join(m for m in METHODS if '@' not in m)}")
    for n in names:
        if "@" in n and tree_variant(n) is None:
            raise HydraspecError(f"method {n!r}: only methods that take a tree accept @TREE "
                                 f"({', '.join(m for m, s in METHODS.items() if 'tree' in s.settings and '@' not in m)})")
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise HydraspecError(f"unknown method{'s' if len(unknown) > 1 else ''} {', '.join(repr(u) for u in unknown)}; "
                             f"known: {', '.join(m for m in METHODS if '@' not in m)}")
    return names


def method_settings(name: str, args) -> dict:
    spec = METHODS[name]
    s = {k: getattr(args, k, None) for k in spec.settings}
    if getattr(args, "prefix_cache", 0) and not name.startswith(("hf-", "ov-")):  # where it applies
        s["prefix_cache"] = args.prefix_cache
    if spec.tree is not None:
        s.update(variant_args(name.partition("@")[0], spec.tree))
    # dynamic-tree sizes only matter with --tree dynamic, and a draft chain has no tree: leaving them out
    # keeps records made before --tree existed resumable
    if str(s.get("tree") or "").strip().lower() != "dynamic":
        s.pop("tree_nodes", None)
        s.pop("tree_depth", None)
        s.pop("tree_topk", None)
    if name == "draft" and s.get("tree") is None:
        s.pop("tree", None)
    for k in ("draft_confidence", "draft_leaves"):
        if k in s and s[k] is None:  # the default: records made before the option stay resumable
            s.pop(k)
    return s


def sync(device) -> None:
    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize(device)


# -- our engine -------------------------------------------------------------------------------------
class EngineRunner(Runner):
    def __init__(self, ctx: BenchContext, drafter):
        self.gen = SpeculativeGenerator(ctx.model, ctx.tokenizer, drafter=drafter)
        if getattr(ctx.args, "prefix_cache", 0):  # earlier turns' keys and values, this method's own
            self.gen.batch.prefix_pool = PrefixPool(ctx.args.prefix_cache)
        self.device = ctx.model.device

    def generate(self, ids, max_new_tokens, temperature, seed, prediction=None):
        sync(self.device)
        t0 = time.perf_counter()
        res = self.gen.generate(input_ids=ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                prediction=prediction)
        sync(self.device)
        wall = time.perf_counter() - t0
        s = res.stats
        return TurnResult(token_ids=list(res.token_ids), text=res.text, finish_reason=res.finish_reason, wall_s=wall,
                          prompt_tokens=len(ids), target_forwards=s.target_forwards, mean_accepted=s.mean_accepted,
                          accept_hist=list(s.accept_hist), prefill_s=s.prefill_s, draft_s=s.draft_s,
                          verify_s=s.verify_s, accept_s=s.accept_s, cached_tokens=s.counters.get("cached_tokens", 0))


def _engine(method: str):
    def factory(ctx: BenchContext) -> Runner:
        a = ctx.args
        if method == "pld":
            drafter = make_drafter("pld", num_tokens=a.pld_tokens)
        elif method == "auto":
            drafter = _auto(ctx)
        elif method in DRAFT_METHODS:
            if ctx.draft is None:
                raise HydraspecError(f"method '{method}' needs --draft-model")
            dm, dtok = ctx.draft
            conf = getattr(a, "draft_confidence", None)
            leaves = leaves_option(a)  # refuses leaves with a tree
            if getattr(a, "tree", None):
                drafter = make_drafter("draft", draft_model=dm, target_tokenizer=ctx.tokenizer, draft_tokenizer=dtok,
                                       confidence=conf, **_tree_options(a))
            elif (shipped := shipped_tree_for(a)) is not None:
                drafter = make_drafter("draft", draft_model=dm, target_tokenizer=ctx.tokenizer, draft_tokenizer=dtok,
                                       tree=shipped)
            else:
                drafter = make_drafter("draft", draft_model=dm, target_tokenizer=ctx.tokenizer,
                                       draft_tokenizer=dtok, confidence=conf, **draft_k_option(a), **leaves)
            if method == "pld+draft":
                drafter = LookupHybridDrafter(drafter, PromptLookupDrafter(num_tokens=a.pld_tokens), prefer_lookup=True)
        elif method == "suffix":
            drafter = make_drafter("suffix", store=suffix_store_for(a))
        else:
            drafter = make_drafter(method)
        return EngineRunner(ctx, drafter)

    return factory


def _auto(ctx: BenchContext):
    """The auto method's drafter: prompt lookup, suffix decoding, predictions, and the draft model and heads where
    given."""
    costly = {}
    if ctx.heads:
        heads, cfg = load_heads(pick_heads(ctx.heads, "eagle"), ctx.model, base_model=ctx.args.model, drafting=True)
        costly.update(auto_heads(heads, cfg, ctx.model.get_input_embeddings()))
    if ctx.draft is not None:
        dm, dtok = ctx.draft
        shipped = shipped_tree_for(ctx.args)
        opts = {"tree": shipped} if shipped is not None else {}
        costly["draft"] = make_drafter("draft", draft_model=dm, target_tokenizer=ctx.tokenizer, draft_tokenizer=dtok,
                                       **opts)
    return make_auto(ctx.model, costly, pld_tokens=ctx.args.pld_tokens, store=suffix_store_for(ctx.args))


def _tree_options(a, max_depth: int | None = None) -> dict:
    """--tree as make_drafter options: 'dynamic' with its sizes, or the tree spec as given (a tree.json
    carries more than its paths, e.g. a draft model's stop), validated here."""
    spec = a.tree
    if isinstance(spec, str) and spec.strip().lower() == "dynamic":
        return {"tree": "dynamic", "tree_nodes": getattr(a, "tree_nodes", None),
                "tree_depth": getattr(a, "tree_depth", None), "tree_topk": getattr(a, "tree_topk", None)}
    load_tree_spec(spec, max_depth=max_depth)
    return {"tree": spec}


def heads_variant(directory) -> str | None:
    """'medusa', 'hydra' or 'hydra++' (Hydra heads with a prefix layer) for a heads directory."""
    try:
        cfg = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if cfg.get("kind") == "hydra" and cfg.get("prefix_layer"):
        return "hydra++"
    return cfg.get("kind")


def pick_heads(dirs, method: str) -> str:
    dirs = [dirs] if isinstance(dirs, str) else list(dirs or [])
    if len(dirs) == 1:
        return dirs[0]
    match = [d for d in dirs if heads_variant(d) == method]
    if len(match) != 1:
        found = ", ".join(f"{d} ({heads_variant(d)})" for d in dirs)
        raise HydraspecError(f"method {method} needs exactly one --heads directory of its kind; given: {found}")
    return match[0]


def _heads(method: str):
    def factory(ctx: BenchContext) -> Runner:
        heads, cfg = load_heads(pick_heads(ctx.heads, method.removeprefix("pld+")), ctx.model,
                                base_model=ctx.args.model, drafting=True)
        spec = getattr(ctx.args, "tree", None)
        opts = _tree_options(ctx.args, heads.num_heads) if spec else {"tree": cfg.get("default_tree")}
        base = method.removeprefix("pld+")
        kind = "hydra" if base == "hydra++" else base
        if method.startswith("pld+"):
            kind = method
            opts["pld_tokens"] = ctx.args.pld_tokens
        if heads.method == "eagle":
            given = getattr(ctx.args, "min_prob", None)
            opts["min_prob"] = given if given is not None else cfg.get("min_prob")
        drafter = make_drafter(kind, heads=heads, embed=ctx.model.get_input_embeddings(), **opts)
        return EngineRunner(ctx, drafter)

    return factory


# -- stock transformers generate() ------------------------------------------------------------------
class HFRunner(Runner):
    """model.generate() with the engine's EOS ids, an all-ones attention mask and no logits processors
    (repetition penalty etc. from the model's generation_config are switched off, so greedy `hf-ar` is
    comparable token for token with `ar`). Sampling: temperature only, top-p/top-k off, and
    torch.manual_seed(seed) before every prompt."""

    def __init__(self, ctx: BenchContext, kind: str):
        self.model, self.tok, self.kind = ctx.model, ctx.tokenizer, kind
        self.eos = sorted(ctx.eos)
        pad = getattr(ctx.tokenizer, "pad_token_id", None)
        self.pad = pad if pad is not None else (self.eos[0] if self.eos else 0)
        self.extra: dict = {}
        if kind == "assisted":
            if ctx.draft is None:
                raise HydraspecError("method 'hf-assisted' needs --draft-model")
            self.extra["assistant_model"] = ctx.draft[0]
        elif kind == "pld":
            self.extra["prompt_lookup_num_tokens"] = ctx.args.pld_tokens
        gc = getattr(ctx.model, "generation_config", None)
        self.has_min_p = getattr(gc, "min_p", None) is not None

    def generate(self, ids, max_new_tokens, temperature, seed):
        dev = self.model.device
        x = torch.tensor([ids], dtype=torch.long, device=dev)
        kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, min_new_tokens=0,
                  eos_token_id=self.eos or None, pad_token_id=self.pad, num_beams=1, repetition_penalty=1.0,
                  no_repeat_ngram_size=0, **self.extra)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, typical_p=1.0)
            if self.has_min_p:
                kw["min_p"] = 0.0
        else:
            kw["do_sample"] = False
        if temperature > 0 and seed is not None:
            torch.manual_seed(seed)
        sync(dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(x, **kw)
        new = out[0, len(ids):].tolist()
        finish = "length"
        eos = set(self.eos)
        for i, t in enumerate(new):  # stop at EOS inclusive, like the engine
            if t in eos:
                new, finish = new[: i + 1], "eos"
                break
        text = self.tok.decode(new, skip_special_tokens=True)
        sync(dev)
        wall = time.perf_counter() - t0
        r = TurnResult(token_ids=new, text=text, finish_reason=finish, wall_s=wall, prompt_tokens=len(ids))
        if self.kind == "ar":
            # Plain decoding: the prefill forward produces token 1 and each later forward one more token,
            # so forwards = new tokens and 1.0 token per forward (the engine's 'ar' reports the same).
            r.target_forwards = len(new)
            r.mean_accepted = 1.0 if new else 0.0
            r.accept_hist = [0, len(new)]
        # hf-assisted / hf-pld: transformers does not expose its forward count; left None.
        return r


def _hf(kind: str):
    return lambda ctx: HFRunner(ctx, kind)


register(MethodSpec("ar", _engine("ar"), "plain autoregressive decoding through the hydraspec engine"))
register(MethodSpec("draft", _engine("draft"), "hydraspec with a draft model (--draft-model, --draft-k)",
                    needs_draft=True,
                    settings=("draft_model", "draft_k", "draft_confidence", "draft_leaves", "tree", "tree_nodes",
                              "tree_depth", "tree_topk")))
register(MethodSpec("pld", _engine("pld"), "hydraspec prompt lookup decoding (--pld-tokens)",
                    settings=("pld_tokens",)))
register(MethodSpec("suffix", _engine("suffix"), "hydraspec suffix decoding (the sequence and earlier answers)"))
register(MethodSpec("auto", _engine("auto"), "hydraspec's drafter chosen per request and step by measured payoff: "
                                              "prompt lookup, suffix decoding, predictions, the draft model and heads "
                                              "if given (--heads DIR or shipped)",
                    settings=("draft_model", "heads", "pld_tokens"), takes_draft=True, takes_heads=True, predicts=True))
register(MethodSpec("pld+draft", _engine("pld+draft"), "hydraspec prompt lookup where it matches, else the draft model "
                                                        "(--draft-model, --pld-tokens)",
                    needs_draft=True,
                    settings=("draft_model", "draft_k", "draft_confidence", "draft_leaves", "tree", "tree_nodes",
                              "tree_depth", "tree_topk", "pld_tokens")))
register(MethodSpec("medusa", _heads("medusa"), "hydraspec with Medusa heads (--heads, --tree)",
                    needs_heads=True, settings=("heads", "tree", "tree_nodes", "tree_depth", "tree_topk")))
register(MethodSpec("hydra", _heads("hydra"), "hydraspec with Hydra heads (--heads, --tree)",
                    needs_heads=True, settings=("heads", "tree", "tree_nodes", "tree_depth", "tree_topk")))
register(MethodSpec("hydra++", _heads("hydra++"), "hydraspec with Hydra++ heads: prefix layer, distilled (--heads)",
                    needs_heads=True, settings=("heads", "tree", "tree_nodes", "tree_depth", "tree_topk")))
register(MethodSpec("eagle", _heads("eagle"), "hydraspec with an EAGLE head: one layer drafting on the target's "
                                              "features (--heads, --tree)",
                    needs_heads=True, settings=("heads", "tree", "min_prob")))
for _m in ("medusa", "hydra", "hydra++", "eagle"):
    register(MethodSpec(f"pld+{_m}", _heads(f"pld+{_m}"),
                        f"hydraspec with prompt lookup merged into the {_m} heads' tree (--heads, --pld-tokens)",
                        needs_heads=True, settings=("heads", "pld_tokens", "tree", "tree_nodes", "tree_depth",
                                                    "tree_topk")))
register(MethodSpec("hf-ar", _hf("ar"), "transformers generate(), plain decoding"))
register(MethodSpec("hf-assisted", _hf("assisted"), "transformers assisted generation with --draft-model",
                    needs_draft=True, settings=("draft_model",)))
register(MethodSpec("hf-pld", _hf("pld"), "transformers prompt lookup decoding (--pld-tokens)",
                    settings=("pld_tokens",)))
