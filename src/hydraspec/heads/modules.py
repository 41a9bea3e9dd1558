"""Draft heads that sit on the target's last hidden state.

Medusa (Cai et al. 2024): head k maps the hidden state h_t of the last verified token to the token
k + 1 steps ahead through residual SiLU blocks and a vocabulary projection; heads are independent.
Hydra (Ankner et al. 2024): head k also sees the input embeddings of the tokens already on the draft
path, so its guess is conditioned on the earlier guesses. Hydra++ uses deeper (4-layer) head MLPs.
The vocabulary projection is either the frozen base lm_head (shared: small checkpoints) or each
head's own copy initialised from it.

Draft vocabulary: heads may project onto a subset of the vocabulary only (the tokens that cover nearly
all of the base model's own answers, chosen by frequency). The vocabulary projection is most of a head's
cost (151,936 x 1,536 weights for Qwen2.5), so this makes drafting and training several times cheaper.
Exactness is untouched: the target verifies every drafted token, and in sampling mode the heads'
distribution over the subset (zero elsewhere) is the q that lossless acceptance uses.
"""
from __future__ import annotations

import torch
from torch import nn

from ..backend import follow_base


class ResBlock(nn.Module):
    """h + SiLU(W h + b), with W and b zero at init so that a fresh block is the identity."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


class Heads(nn.Module):
    """Common part: K heads, each ending in a vocabulary projection (shared lm_head or its own)."""

    kind = "base"

    @property
    def method(self) -> str:
        """The drafting method that runs these heads (an EAGLE-3 head drafts as an EAGLE head does)."""
        return self.kind

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int, lm_head: nn.Module | None,
                 own_projection: bool, vocab_subset=None):
        super().__init__()
        self.hidden, self.vocab, self.num_heads, self.num_layers = hidden, vocab, num_heads, num_layers
        self.own_projection = own_projection
        if vocab_subset is not None:
            sub = torch.as_tensor(vocab_subset, dtype=torch.long)
            if sub.ndim != 1 or sub.numel() == 0 or int(sub.min()) < 0 or int(sub.max()) >= vocab or \
                    sub.unique().numel() != sub.numel():
                raise ValueError(f"vocab_subset must be distinct token ids in [0, {vocab})")
            self.register_buffer("subset", sub)
        else:
            self.subset = None
        out = vocab if self.subset is None else self.subset.numel()
        if own_projection:
            self.proj = nn.ModuleList(nn.Linear(hidden, out, bias=False) for _ in range(num_heads))
            if lm_head is not None:
                w = lm_head.weight.data if self.subset is None else lm_head.weight.data[self.subset]
                for p in self.proj:
                    p.weight.data.copy_(w)
            self._shared = None
        else:
            if lm_head is None:
                raise ValueError("heads with a shared projection need the base model's lm_head")
            self.proj = None
            self._shared = [lm_head]  # a list keeps the frozen base head out of this module's parameters
            self._shared_sub = None  # frozen rows of lm_head for the draft vocabulary, made on first use
            self._shared_dense = None  # (training on a GGUF base) those rows as a float matrix
        self.prefix = None  # Hydra++'s prefix-attention layer (heads.prefix.PrefixLayer), set by build_heads

    @classmethod
    def for_model(cls, model, num_heads: int = 4, num_layers: int = 1, own_projection: bool = False,
                  vocab_subset=None, **_) -> "Heads":
        """Fresh heads of this kind for ``model`` (its hidden size, vocabulary and lm_head)."""
        cfg = model.config.get_text_config(decoder=True)
        return cls(cfg.hidden_size, cfg.vocab_size, num_heads=num_heads, num_layers=num_layers,
                   lm_head=model.get_output_embeddings(), own_projection=own_projection, vocab_subset=vocab_subset)

    def extra_config(self) -> dict:
        """What a checkpoint's config.json needs beyond the common fields to rebuild these heads."""
        return {}

    def prefixed(self, hidden: torch.Tensor) -> torch.Tensor:
        """Training view: the hidden states [T, dim] of a whole sequence as the heads read them."""
        return hidden if self.prefix is None else self.prefix(hidden)

    @property
    def out_vocab(self) -> int:
        """Width of the heads' logits: the vocabulary, or the draft vocabulary."""
        return self.vocab if self.subset is None else self.subset.numel()

    def token_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Map indices into the heads' logits to token ids."""
        return idx if self.subset is None else self.subset[idx]

    def full_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., out_vocab] probabilities -> [..., vocab] (zero outside the draft vocabulary)."""
        if self.subset is None:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.vocab)
        full[..., self.subset] = probs
        return full

    def projection_weight(self, k: int = 0) -> torch.Tensor:
        """Head k's vocabulary projection as a dense float32 matrix [out_vocab, dim] (for export)."""
        if self.own_projection:
            return self.proj[k].weight.detach().float()
        base = self._shared[0]
        if hasattr(base, "dequantized"):  # a GGUF lm_head (hydraspec.cpu.gguf)
            return base.dequantized(self.subset).float()
        w = base.weight.detach()
        return (w if self.subset is None else w[self.subset.to(w.device)]).float()

    def project(self, k: int, x: torch.Tensor) -> torch.Tensor:
        if self.own_projection:
            head = self.proj[k]
            return head(x.to(head.weight.dtype))
        base = self._shared[0]
        if hasattr(base, "select") and torch.is_grad_enabled():  # training on a GGUF base: its rows dequantized
            # once (the kernel has no backward), so that gradients reach what feeds the projection
            if not self._shared_dense:
                self._shared_dense = (base.dequantized(self.subset).float(),)
            return torch.nn.functional.linear(x.float(), self._shared_dense[0].to(x.device))
        if hasattr(base, "select"):  # a base lm_head at the GGUF file's precision (hydraspec.cpu.gguf)
            if self.subset is None:
                return base(x.to(torch.bfloat16))
            if not self._shared_sub:
                self._shared_sub = (base.select(self.subset),)
            return self._shared_sub[0](x.to(torch.bfloat16))
        if self.subset is None:
            return base(x.to(base.weight.dtype))
        lin = self._shared_sub[0] if self._shared_sub else None  # a tuple: not a registered submodule
        if lin is None or lin.weight.dtype != base.weight.dtype or lin.weight.device != base.weight.device:
            lin = nn.Linear(self.hidden, self.subset.numel(), bias=False, device=base.weight.device,
                            dtype=base.weight.dtype)
            lin.weight = nn.Parameter(base.weight.detach()[self.subset.to(base.weight.device)].contiguous(),
                                      requires_grad=False)
            lin = follow_base(lin, base)  # the base runs on the CPU kernels: so do these rows of it
            self._shared_sub = (lin,)
        return lin(x.to(lin.weight.dtype))


class MedusaHeads(Heads):
    kind = "medusa"

    def __init__(self, hidden, vocab, num_heads=4, num_layers=1, lm_head=None, own_projection=False,
                 vocab_subset=None):
        super().__init__(hidden, vocab, num_heads, num_layers, lm_head, own_projection, vocab_subset)
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)]) for _ in range(num_heads))

    def features(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.blocks[k](hidden)

    def logits(self, k: int, hidden: torch.Tensor, path_emb: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [..., dim] base hidden state -> [..., vocab] logits of head k (0-based: k + 2 ahead)."""
        return self.project(k, self.features(k, hidden))


class HydraHeads(Heads):
    """Head k (0-based) reads [h_t, e(x_{t+1}), ..., e(x_{t+k+1})]: the base hidden state and the input
    embeddings of the k + 1 path tokens after it (the pending token and k drafted ones)."""

    kind = "hydra"

    def __init__(self, hidden, vocab, num_heads=4, num_layers=1, lm_head=None, own_projection=False,
                 vocab_subset=None):
        super().__init__(hidden, vocab, num_heads, num_layers, lm_head, own_projection, vocab_subset)
        self.inp = nn.ModuleList(nn.Linear(hidden * (k + 2), hidden) for k in range(num_heads))
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)]) for _ in range(num_heads))

    def features(self, k: int, hidden: torch.Tensor, path_emb: torch.Tensor) -> torch.Tensor:
        """hidden: [..., dim]; path_emb: [..., k + 1, dim] embeddings of the path tokens."""
        x = torch.cat([hidden, path_emb.flatten(-2)], dim=-1)
        return self.blocks[k](torch.nn.functional.silu(self.inp[k](x)) + hidden)

    def logits(self, k: int, hidden: torch.Tensor, path_emb: torch.Tensor | None = None) -> torch.Tensor:
        return self.project(k, self.features(k, hidden, path_emb))


KINDS = {"medusa": MedusaHeads, "hydra": HydraHeads}
