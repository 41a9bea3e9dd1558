"""The draft tree shipped for the offline Qwen pair: chosen by name and precision, used only when no draft
shape is asked for, and a valid tree.json that the drafter takes."""
import argparse

import pytest

import tiny
from hydraspec import SpeculativeGenerator, make_drafter
from hydraspec.models import shipped_draft_tree
from hydraspec.options import default_draft_shape, shipped_tree_for
from hydraspec.tree import load_tree_spec

T, D = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def _args(**kw):
    base = dict(model=T, draft_model=D, device="cpu", quant="auto", draft_quant="w4a8", tree=None, draft_tree=None,
                draft_k=None, no_dynamic=False, draft_confidence=None, draft_leaves=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_shipped_tree_is_found_by_name_and_precision():
    path = shipped_draft_tree(T, D, "cpu", "gguf", "w4a8")
    assert path is not None and path.is_file()
    assert load_tree_spec(str(path))  # a valid tree.json
    assert shipped_draft_tree(T, D, "cpu", "none", "w4a8") is None  # another precision: no shipped tree
    assert shipped_draft_tree(D, T, "cpu", "gguf", "w4a8") is None  # another pair
    assert shipped_draft_tree("some/hub-model", D, "cpu", "auto", "auto") is None


@pytest.mark.parametrize("given", [dict(draft_k=5), dict(tree="[[0]]"), dict(draft_tree="2,1"), dict(no_dynamic=True),
                                   dict(draft_confidence=0.5), dict(draft_leaves=1)])
def test_any_draft_shape_option_turns_the_shipped_tree_off(given, capsys):
    assert default_draft_shape(_args())
    assert shipped_tree_for(_args()) is not None
    assert "drafting with the tree chosen" in capsys.readouterr().err
    assert not default_draft_shape(_args(**given))
    assert shipped_tree_for(_args(**given)) is None


def test_the_shipped_tree_drafts_exactly(tok):
    """The drafter built from the shipped file decodes exactly as plain decoding (tiny stand-in models)."""
    target = tiny.make_model("llama", seed=3)
    draft = tiny.make_model("llama", seed=3)
    prompt = [5, 9, 2, 40, 17]
    ref = tiny.hf_greedy(target, prompt, 20)
    drafter = make_drafter("draft", draft_model=draft, tree=str(shipped_draft_tree(T, D, "cpu", "gguf", "w4a8")))
    res = SpeculativeGenerator(target, tok, drafter).generate(input_ids=prompt, max_new_tokens=20)
    assert res.token_ids == ref
    assert res.stats.mean_accepted > 1.0
