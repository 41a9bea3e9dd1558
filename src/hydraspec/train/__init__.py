from .data import answer_prompts, load_answers
from .losses import head_positions, heads_loss
from .fit import train_heads
from .trainer import evaluate

__all__ = ["answer_prompts", "load_answers", "head_positions", "heads_loss", "train_heads", "evaluate"]
