from .data import answer_prompts, load_answers
from .losses import head_positions, heads_loss
from .trainer import evaluate, train_heads

__all__ = ["answer_prompts", "load_answers", "head_positions", "heads_loss", "train_heads", "evaluate"]
