from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..cache import allocate_rows, new_cache, set_length
from ..errors import HydraspecError
from ..prefix_pool import PrefixPool
from ..sampling import sample_without_replacement
from ..tree import DraftTree, load_tree_spec, parents_from_paths, shape_of, tree_stop
from ..verify import check_supported, forward_nodes
from .base import DecodeState, Drafter, RowStates, Verdict, capacity_of, next_length
from .draft_batch import DraftBatch
from .heads import prefix_closed, reindex


@dataclass
class DraftSeq:
    """One sequence's draft cache (tree modes; chains share DraftBatch's)."""

    cache: object
    n_cached: int  # tokens of the sequence in the draft cache
    k: int  # current chain length
    n_fed: int = 0  # nodes of the last proposal fed to the draft model (they sit in the cache)
    fed_slot: dict[int, int] | None = None  # leaves: tree index -> draft cache slot, where they differ
    leaf_nodes: set[int] = field(default_factory=set)  # indices of the last proposal's runner-up leaves


def check_vocab(target_tok, draft_tok) -> None:
    """Refuse a draft model whose tokenizer maps ids to different tokens than the target's."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = len(set(tv.items()) - set(dv.items()))
        raise HydraspecError(
            f"draft model's tokenizer is incompatible with the target's ({len(dv)} vs {len(tv)} tokens, "
            f"{only_t} target tokens differ): a draft model must share the target's vocabulary"
        )


DEFAULT_CONFIDENCE = 0.4  # the chain's stop: the draft's top probability below this ends a draft
STOPS = ("token", "path")  # what the confidence stop tests: the next token's probability, or the whole chain's
DEFAULT_LEAF_GAIN = 0.05  # a runner-up leaf must be estimated to add at least this many tokens per step
POOL_TOKENS = 8192  # draft keys and values of earlier sequences kept (the 0.5B Qwen: 12 KB a token)


def log_top_prob(logits: torch.Tensor) -> torch.Tensor:
    """log of the largest probability under `logits` (last dimension): what the confidence stop tests."""
    return logits.max(-1).values - torch.logsumexp(logits, -1)


class DraftModelDrafter(Drafter):
    """Drafting with a smaller causal LM sharing the target's tokenizer (Leviathan et al. 2023).

    Chain mode drafts k tokens one forward each; with `dynamic` the length follows transformers'
    heuristic (start at k, +2 after a step where everything was accepted, -1 otherwise). Tree mode
    (`widths`, e.g. [2, 2, 1]) expands `widths[d]` children per node at depth d, one forward per depth
    over all nodes of that depth under a tree mask. Greedy takes the draft's top tokens; sampling draws
    children without replacement from the draft's warped distribution and reports it as q.
    The draft model keeps its own cache, compacted to the accepted path after every step.
    `confidence`: in greedy chain mode, stop drafting once the draft's top probability falls below it
    (default 0.4). With ``stop="path"`` the test is on the whole chain instead: drafting stops once the
    product of the draft's top probabilities along the chain (its estimate that every drafted token is
    accepted) falls below `confidence`, so a draft token is added only while it is likely enough to be
    reached and taken to pay for its forward and verify row; confident runs (code) draft long chains,
    unsure text (chat) short ones.
    `tree`: a static tree of sibling-rank paths (Medusa "choices", e.g. from `hydraspec build-tree`, a
    tree.json file or its dict) instead of `widths`: node [.., r] holds its parent's rank-r draft token.
    With `confidence` given (default: off for static trees), greedy decoding cuts a static tree at the
    first level where the draft model's top token has probability below it under every parent, as the
    chain stops drafting.
    `leaves` (greedy chain mode): up to this many runner-up tokens hang as extra, never-expanded leaves
    on the chain: the draft's second choice at a chain position, and its first and second choices where
    the confidence stop ended the chain. Their logits are already computed, so a leaf costs one verify
    row and no draft forward; if the target rejects the chain token there but takes the leaf, the step
    emits one more token. Leaves are ranked by their estimated gain (the draft's probability of reaching
    the position times the leaf's probability) and kept when it is at least `leaf_gain`.
    `pool_tokens` (tree modes): the draft model's keys and values of finished sequences are kept, up to this
    many tokens (hydraspec.prefix_pool), and a new sequence starts from the longest prefix it shares with
    one of them: a chat's next turn, or any prompt after the same system prompt, reads only the rest. 0: off.
    """

    name = "draft"

    def __init__(self, model, k: int = 5, dynamic: bool = True, widths: list[int] | None = None,
                 max_k: int = 16, confidence: float | None = None, tree=None, leaves: int = 0,
                 leaf_gain: float = DEFAULT_LEAF_GAIN, stop: str = "token", pool_tokens: int = POOL_TOKENS):
        check_supported(model)
        self.model = model
        if stop not in STOPS:
            raise HydraspecError(f"unknown draft stop '{stop}'; choose one of: {', '.join(STOPS)}")
        self.stop = stop
        if leaves < 0:
            raise HydraspecError(f"draft leaves must be >= 0, got {leaves}")
        if not 0 <= leaf_gain <= 1:
            raise HydraspecError(f"leaf gain must be in [0, 1], got {leaf_gain}")
        self.leaves, self.leaf_gain = leaves, leaf_gain
        self.tree_parents = None
        if tree is not None:
            if widths:
                raise HydraspecError("give a draft tree either as widths or as paths, not both")
            self.tree_paths = load_tree_spec(tree)
            if confidence is None:  # a tree.json from build-tree carries the stop it was chosen with
                confidence = tree_stop(tree)
            self.tree_parents, self.tree_ranks = parents_from_paths(self.tree_paths)
            dynamic = False
        self.widths = list(widths) if widths else None
        if self.widths and any(w < 1 for w in self.widths):
            raise HydraspecError("tree widths must be positive integers")
        self.k0, self.max_k = k, max_k
        self.dynamic = dynamic and not self.widths and self.tree_parents is None
        if confidence is None:  # on for the chain, off for a static tree unless asked for
            confidence = 0.0 if self.tree_parents is not None else DEFAULT_CONFIDENCE
        if confidence < 0 or confidence >= 1:
            raise HydraspecError(f"draft confidence must be in [0, 1), got {confidence}")
        self.confidence = confidence
        self.log_confidence = math.log(confidence) if confidence > 0 else float("-inf")
        if self.widths:
            n, level = 0, 1
            for w in self.widths:
                level *= w
                n += level
            self.max_nodes = n
        else:
            self.max_nodes = max_k if self.dynamic else k
        if self.tree_parents is not None:
            self.max_nodes = len(self.tree_parents)
        if self.leaves and (self.widths or self.tree_parents is not None):
            raise HydraspecError("draft leaves hang on the draft chain only, not on a tree")
        self.max_nodes += self.leaves
        self.pool = PrefixPool(pool_tokens) if pool_tokens else None
        self.rows: RowStates[DraftSeq] = RowStates(self.start, self._pool_row)
        self.batch = DraftBatch(self)

    def _capacity(self, capacity: int) -> int:
        return capacity + self.max_nodes + 1

    def _batched(self) -> bool:
        """Chain mode drafts every row at once (DraftBatch); trees, leaves and subclasses row by row."""
        return type(self) is DraftModelDrafter and not self.widths and not self.leaves and self.tree_parents is None

    def propose(self, states: list[DecodeState]) -> list[DraftTree]:
        if self._batched():
            return self.batch.propose(states)
        return [self.propose_one(self.rows.of(s), s) for s in states]

    def observe(self, states: list[DecodeState], verdicts: list[Verdict]) -> None:
        if self._batched():
            self.batch.observe(states, verdicts)
            return
        for s, v in zip(states, verdicts):
            row = self.rows.get(s)
            if row is not None:
                self.observe_one(row, v.accepted)

    @torch.inference_mode()
    def start(self, state: DecodeState) -> DraftSeq:
        """A sequence's own draft cache, then the draft model's prefill of its prompt (all but the pending
        token) after what the pool holds of it, so that the first proposal feeds one token like every later
        one."""
        row = DraftSeq(new_cache(self.model, self._capacity(capacity_of(state))), 0, self.k0)
        allocate_rows(row.cache, self.model, 1)
        toks = state.tokens
        if len(toks) > 1:
            have = self.pool.load(row.cache, 0, toks[:-1]) if self.pool is not None else 0
            set_length(row.cache, have)
            if have < len(toks) - 1:
                dev = self.model.device
                forward_nodes(self.model, row.cache, torch.tensor(toks[have:-1], dtype=torch.long, device=dev),
                              torch.arange(have, len(toks) - 1, device=dev), None, have, last_only=True)
            row.n_cached = len(toks) - 1
        return row

    def _pool_row(self, state: DecodeState, row: DraftSeq) -> None:
        """A finished sequence's draft keys and values go to the pool (its first n_cached tokens)."""
        if self.pool is not None and row.n_cached:
            self.pool.store(row.cache, 0, state.tokens[:row.n_cached])

    def forget(self) -> None:
        """The pool's entries go, finished sequences not yet swept into it included."""
        self.rows.sweep()
        if self.pool is not None:
            self.pool.clear()

    @property
    def reused(self) -> int:
        return self.pool.hit_tokens if self.pool is not None else 0

    def known(self, state: DecodeState) -> int:
        if self.pool is None or self.rows.get(state) is not None:
            return 0
        self.rows.sweep()  # finished sequences into the pool first
        return self.pool.match(state.tokens[:-1])[0]

    def _unsure(self, logits: torch.Tensor) -> bool:
        """The draft model's top probability under these logits is below `confidence`."""
        return log_top_prob(logits).item() < self.log_confidence

    @torch.inference_mode()
    def propose_one(self, row: DraftSeq, state: DecodeState) -> DraftTree:
        toks = state.tokens
        dev = self.model.device
        feed = torch.tensor(toks[row.n_cached:], dtype=torch.long, device=dev)
        pos = torch.arange(row.n_cached, len(toks), device=dev)
        logits, _ = forward_nodes(self.model, row.cache, feed, pos, None, row.n_cached, last_only=True)
        row.n_cached = prefix = len(toks)
        sampling, greedy = state.sampling, state.sampling.greedy
        if self.tree_parents is not None:
            return self._propose_paths(row, state, logits[-1], prefix)
        widths = self.widths if self.widths else [1] * row.k

        tokens: list[int] = []
        parents: list[int] = []
        qrows: list[torch.Tensor] = []
        frontier = [(-1, logits[-1])]  # (parent node, logits at that parent)
        fed = 0
        reach = 0.0  # path stop: log of the draft's probability that the chain so far is all accepted
        row.fed_slot, row.leaf_nodes = None, set()
        leafy = greedy and self.leaves > 0
        dists: list[torch.Tensor] = []  # chain mode with leaves: logits at each chain position (+ the stop's)
        for depth, width in enumerate(widths):
            for parent, lg in frontier:
                if greedy:
                    if leafy:
                        dists.append(lg)
                    top = torch.topk(lg, width)
                    if self.confidence > 0 and not self.widths:
                        if self.stop == "path":
                            reach += log_top_prob(lg).item()
                            if tokens and reach < self.log_confidence:
                                continue  # always propose at least one token
                        elif tokens and self._unsure(lg):
                            continue
                    cand = top.indices
                else:
                    p = sampling.probs(lg)
                    cand = sample_without_replacement(p, width, state.generator)
                for x in cand.tolist():
                    tokens.append(x)
                    parents.append(parent)
                    if not greedy:
                        qrows.append(p)
            new = list(range(fed, len(tokens)))
            if not new or depth == len(widths) - 1:
                break
            shape = shape_of(tuple(parents))
            anc = None if shape.is_chain else shape.ancestors[fed:len(tokens), :len(tokens)]
            ids = torch.tensor(tokens[fed:], dtype=torch.long, device=dev)
            positions = (prefix + shape.depth[fed:]).to(dev)
            lg_new, _ = forward_nodes(self.model, row.cache, ids, positions, anc, prefix)
            frontier = list(zip(new, lg_new))
            fed = len(tokens)
        row.n_fed = fed
        if leafy:
            return self._with_leaves(row, tokens, dists, fed)
        q = None
        if qrows:
            q = torch.stack(qrows)
        return DraftTree(torch.tensor(tokens, dtype=torch.long), tuple(parents), q)

    def _with_leaves(self, row: DraftSeq, chain: list[int], dists: list[torch.Tensor], fed: int) -> DraftTree:
        """The greedy chain plus up to `leaves` runner-up leaves (see the class doc), in BFS order.
        dists[j]: the draft's logits the token at chain position j was (or, at j == len(chain), would
        have been) chosen from."""
        n = len(chain)
        lg = torch.stack(dists).float()
        top = torch.topk(lg, 2, dim=-1)
        p = (top.values - torch.logsumexp(lg, -1, keepdim=True)).exp().tolist()
        ids = top.indices.tolist()
        cands = []  # (gain, position, token)
        reach = 1.0  # the draft's probability that the chain is accepted up to position j
        for j in range(len(dists)):
            if j < n:
                cands.append((reach * p[j][1], j, ids[j][1]))
                reach *= p[j][0]
            else:  # where the confidence stop ended the chain: its first and second choices
                cands += [(reach * p[j][0], j, ids[j][0]), (reach * p[j][1], j, ids[j][1])]
        cands = sorted((c for c in cands if c[0] >= self.leaf_gain), reverse=True)[: self.leaves]
        if not cands:
            return DraftTree(torch.tensor(chain, dtype=torch.long), tuple(range(-1, n - 1)))
        leaves_at: dict[int, list[int]] = {}
        for _, j, x in sorted(cands, key=lambda c: (c[1], -c[0])):
            leaves_at.setdefault(j, []).append(x)
        tokens, parents, chain_idx = [], [], []
        for j in range(max(n, max(leaves_at) + 1)):
            parent = chain_idx[j - 1] if j else -1
            if j < n:
                chain_idx.append(len(tokens))
                tokens.append(chain[j])
                parents.append(parent)
            for x in leaves_at.get(j, []):
                row.leaf_nodes.add(len(tokens))
                tokens.append(x)
                parents.append(parent)
        row.fed_slot = {chain_idx[j]: j for j in range(fed)}
        return DraftTree(torch.tensor(tokens, dtype=torch.long), tuple(parents))

    def _propose_paths(self, row: DraftSeq, state: DecodeState, root_logits: torch.Tensor, prefix: int) -> DraftTree:
        """A static tree of rank paths: one draft forward per depth over all nodes of that depth."""
        parents, ranks = self.tree_parents, self.tree_ranks
        shape = shape_of(parents)
        n, dev = len(parents), self.model.device
        depth = shape.depth.tolist()
        max_d = depth[-1]
        greedy, sampling = state.sampling.greedy, state.sampling
        tokens = [0] * n
        qrows: list[torch.Tensor | None] = [None] * n
        drawn = [greedy] * n
        row_of = {-1: root_logits}
        start = 0
        for d in range(max_d + 1):
            end = start
            while end < n and depth[end] == d:
                end += 1
            kids: dict[int, list[int]] = {}
            for i in range(start, end):
                kids.setdefault(parents[i], []).append(i)
            if greedy and d > 0 and self.confidence > 0 and all(self._unsure(row_of[p]) for p in kids):
                # unsure at every parent of this level (as the chain stops drafting): verify the levels
                # above only, all of which sit in the draft cache
                row.n_fed = start
                return DraftTree(torch.tensor(tokens[:start], dtype=torch.long), parents[:start])
            for p, children in kids.items():
                lg = row_of[p]
                if greedy:
                    most = max(ranks[c] for c in children) + 1
                    top = [int(lg.argmax())] if most == 1 else torch.topk(lg, most).indices.tolist()
                    for c in children:
                        tokens[c] = top[ranks[c]]
                else:
                    probs = sampling.probs(lg)
                    draws = sample_without_replacement(probs, len(children), state.generator).tolist()
                    for c, x in zip(children, draws):
                        tokens[c], qrows[c], drawn[c] = x, probs, True
            if d == max_d:
                break
            anc = shape.ancestors[start:end, :end]
            ids = torch.tensor(tokens[start:end], dtype=torch.long, device=dev)
            lg_new, _ = forward_nodes(self.model, row.cache, ids, (prefix + shape.depth[start:end]).to(dev),
                                      None if shape.is_chain else anc, prefix)
            for i, lg_i in zip(range(start, end), lg_new):
                row_of[i] = lg_i
            start = end
        row.n_fed = start  # nodes of depth < max_d, a BFS prefix, sit in the draft cache in index order
        if greedy:
            return DraftTree(torch.tensor(tokens, dtype=torch.long), parents)
        if not all(drawn):  # fewer tokens with nonzero probability than children: cut the tree

            keep = prefix_closed(parents, {i for i in range(n) if drawn[i]})
            row.n_fed = 0  # indices change: keep nothing of this tree in the draft cache
            return DraftTree(torch.tensor([tokens[i] for i in keep], dtype=torch.long), reindex(parents, keep),
                             torch.stack([qrows[i] for i in keep]) if keep else None)
        return DraftTree(torch.tensor(tokens, dtype=torch.long), parents, torch.stack(qrows))

    def observe_one(self, row: DraftSeq, accepted: list[int]) -> None:
        if row.fed_slot is not None:  # leaves moved the chain's indices: map them to cache slots
            kept = [row.fed_slot[i] for i in accepted if i in row.fed_slot]
        else:
            kept = [i for i in accepted if i < row.n_fed]
        prefix = row.n_cached
        row.cache.keep(prefix, torch.tensor(kept, dtype=torch.long))
        row.n_cached = prefix + len(kept)
        if self.dynamic:
            row.k = next_length(row.k, len(accepted), row.k, self.max_k)

