"""`hydraspec train-heads` on the command line: its options, and the job (:mod:`hydraspec.train.job`) they make."""
from __future__ import annotations

from ..options import add_model_args
from .job import HeadsJob, run_heads_job

__all__ = ["add_parser", "run"]


def run(args) -> int:
    return run_heads_job(HeadsJob.from_args(args))


def add_parser(subparsers) -> None:
    """Register `train-heads` on an argparse subparsers object (``args.func`` runs it)."""
    t = subparsers.add_parser("train-heads", help="self-distil and train Medusa/Hydra draft heads (frozen base)")
    add_model_args(t)
    t.add_argument("--kind", required=True, choices=("medusa", "hydra", "hydra++", "eagle", "eagle3"),
                   help="hydra++ = 4-layer Hydra heads distilled from the base model's distribution, "
                        "reading the output of one extra prefix-attention decoder layer; eagle = one decoder "
                        "layer drafting autoregressively on the base's features (EAGLE), distilled; eagle3 = the "
                        "same on a low, a middle and a high layer, trained on its own guesses (EAGLE-3)")
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
    t.add_argument("--answers-model", metavar="NAME", default="auto",
                   help="a smaller model with the same tokenizer writes the answers instead (several times faster "
                        "than the base); the base reads each prompt + answer at prefill speed and its own next-token "
                        "distributions are the targets, so only distilled kinds (hydra++, eagle, eagle3) take it. "
                        "auto (the default): for those kinds, the offline registry's smaller model of the base's "
                        "family where there is one (Qwen2.5-Coder 1.5B: the 0.5B; per data token the heads learn "
                        "the same, at a third of the CPU time: BENCHMARKS.md), else the base; none: the base")
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
    t.add_argument("--lr", type=float, help="peak learning rate (warm-up, then cosine to a tenth); default 1e-3, "
                                            "5e-4 for eagle3")
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
    t.add_argument("--init", metavar="DIR",
                   help="start from these heads (a checkpoint of --kind, e.g. shipped ones) instead of fresh ones: "
                        "their shapes and draft vocabulary are kept, so more data goes on from what they learnt")
    t.set_defaults(func=run, quant="none")  # heads train on the dequantized base
