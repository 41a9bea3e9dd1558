"""The bench's shared argument handling: comma lists, the checks that methods get what they need, and
the model loader that honours --quant."""
from __future__ import annotations

from ..errors import HydraspecError
from ..models import load_model
from .methods import METHODS

__all__ = ["split_list", "check_args", "default_loader"]


def split_list(text) -> list[str] | None:
    if not text:
        return None
    items = text.split(",") if isinstance(text, str) else list(text)
    return [s.strip() for s in items if s.strip()] or None


def check_args(args, methods: list[str]) -> None:
    specs = [METHODS[m] for m in methods]
    if getattr(args, "heads", None) and not any(s.needs_heads or s.takes_heads for s in specs):
        raise HydraspecError("--heads is only used by the auto, medusa, hydra and eagle methods; add one to --methods")
    need_heads = [s.name for s in specs if s.needs_heads]
    if need_heads and not getattr(args, "heads", None):
        raise HydraspecError(f"method{'s' if len(need_heads) > 1 else ''} {', '.join(need_heads)} need --heads")
    need_draft = [s.name for s in specs if s.needs_draft]
    if need_draft and not getattr(args, "draft_model", None):
        raise HydraspecError(f"method{'s' if len(need_draft) > 1 else ''} {', '.join(need_draft)} "
                             f"need{'' if len(need_draft) > 1 else 's'} --draft-model")
    if args.max_new_tokens <= 0:
        raise HydraspecError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise HydraspecError(f"--temperature must be >= 0, got {args.temperature}")
    if (args.draft_k is not None and args.draft_k < 1) or args.pld_tokens < 1:
        raise HydraspecError("--draft-k and --pld-tokens must be at least 1")
    if getattr(args, "skip", 0) < 0:
        raise HydraspecError(f"--skip must be at least 0, got {args.skip}")
    if args.limit is not None and args.limit < 1:
        raise HydraspecError(f"--limit must be at least 1, got {args.limit}")


def default_loader(args):
    """load_model with the bench's --quant (for the target; the draft follows --draft-quant)."""
    def load(name, dtype, device):
        return load_model(name, dtype=dtype, device=device, quant=getattr(args, "quant", "none"))
    return load
