"""The draft vocabulary cut: the kept rows' logits are the full layer's, the others -inf."""
import pytest
import torch
from torch import nn

from hydraspec import HydraspecError
from hydraspec.draft_vocab import DraftVocabHead, cut_output, greedy_tops, kept_ids, kept_ids_of, trim_draft_vocab


class _Tiny(nn.Module):
    def __init__(self, vocab=50, hidden=8):
        super().__init__()
        self.head = nn.Linear(hidden, vocab, bias=True)

    def get_output_embeddings(self):
        return self.head

    def set_output_embeddings(self, m):
        self.head = m


def test_kept_rows_equal_the_full_layer_and_the_rest_are_never_proposed():
    m = _Tiny()
    full = m.head
    x = torch.randn(3, 8)
    want = full(x)
    assert trim_draft_vocab(m, 20, [45, 49, 99]) == 22
    got = m.head(x)
    assert isinstance(m.head, DraftVocabHead) and got.shape == want.shape
    keep = kept_ids(20, 50, [45, 49, 99]).tolist()
    assert keep == list(range(20)) + [45, 49]
    torch.testing.assert_close(got[:, keep], want[:, keep], rtol=0, atol=0)
    rest = [i for i in range(50) if i not in keep]
    assert torch.isinf(got[:, rest]).all() and (got[:, rest] < 0).all()
    assert set(got.argmax(-1).tolist()) <= set(keep)


def test_a_cut_as_large_as_the_vocabulary_changes_nothing_and_zero_is_refused():
    m = _Tiny()
    head = m.head
    assert trim_draft_vocab(m, 50, []) == 50 and m.head is head
    with pytest.raises(HydraspecError, match="at least 1"):
        trim_draft_vocab(m, 0, [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_picks_over_the_kept_ids_equal_those_over_the_whole_row(dtype):
    torch.manual_seed(0)
    model = _Tiny()
    assert kept_ids_of(model) is None
    cut_output(model, torch.tensor([3, 7, 11, 30, 45]))  # scattered ids: a pick must map back to them
    keep = kept_ids_of(model)
    logits = model.get_output_embeddings()(torch.randn(4, 8)).to(dtype)
    full = logits.float()
    ids, lps = greedy_tops(logits, keep)
    assert ids == full.argmax(-1).tolist() == greedy_tops(logits)[0]
    assert all(i in keep.tolist() for i in ids)
    want = (full.max(-1).values - torch.logsumexp(full, -1)).tolist()
    assert lps == pytest.approx(want, abs=1e-5)
