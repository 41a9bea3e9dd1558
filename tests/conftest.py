import os
import sys
import warnings

import pytest
import torch

# tiny models run fastest on one thread; extra threads only add contention on a small shared machine
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))  # `import tiny` from the test modules

warnings.filterwarnings("ignore", message=".*generation flags are not valid.*")
warnings.filterwarnings("ignore", message=".*pad_token_id.*")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
    import tiny
    from hydraspec.features import set_feature_layers

    for model in tiny.cached_models():  # EAGLE-3 heads set the layers a model's forwards hand out
        set_feature_layers(model, None)


@pytest.fixture
def tok():
    """A fresh tokenizer per test: tests that set an EOS on it must not leak it into others."""
    import tiny

    return tiny.make_tokenizer()


def pytest_terminal_summary(terminalreporter, config):
    """Name the shuffled order (pytest-randomly) even under -q, so that a failure that depends on it reruns."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int):
        terminalreporter.write_line(f"test order: rerun with -p randomly --randomly-seed={seed}")
