from foresight.drafter_worker.ngram import NgramProposer
from foresight.spec.ngram import lookup, lookup_match
from foresight.drafter_worker.proposer import Draft, DraftContext, StatelessProposer
from foresight.drafter_worker.strategies import HybridProposer
from foresight.protocol.messages import HiddenLayout


def test_longest_most_recent_match_wins():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    # suffix 3-gram [1,2,3] last occurred at index 4, followed by 4, 5, 1, ...
    assert lookup(tokens, 3, n_max=3, n_min=1) == [4, 5, 1]


def test_falls_back_to_shorter_ngrams_and_respects_max_drafts():
    tokens = [7, 8, 1, 2, 9, 9, 2]
    assert lookup(tokens, 2, n_max=3, n_min=1) == [9, 9]
    assert lookup(tokens, 0, n_max=3, n_min=1) == []


def test_no_match_gives_no_draft():
    assert lookup([1, 2, 3, 4], 5, n_max=3, n_min=1) == []
    assert lookup([1, 2, 3, 1], 5, n_max=3, n_min=2) == []
    assert lookup([5], 5, n_max=3, n_min=1) == []


def test_inside_a_run_an_earlier_occurrence_gives_the_whole_continuation():
    tokens = [4, 7, 7, 7, 7, 7, 7]
    # the most recent occurrence of [7, 7] is followed by one 7 only; the first one by four
    assert lookup(tokens, 3, n_max=2, n_min=2) == [7, 7, 7]
    assert lookup_match([1, 2, 5, 1, 2], 4, n_max=3, n_min=1) == ([5, 1, 2], 2)  # longest there is


def test_hybrid_drafts_by_lookup_on_a_long_match_else_by_the_model():
    class Model(StatelessProposer):
        name, layout, supports_foresight = "m", HiddenLayout((1,), 4), False

        def propose(self, ctx, max_drafts):
            return Draft([99] * max_drafts, [0.9] * max_drafts)

    hybrid = HybridProposer(Model(), NgramProposer(4, 2), min_match=3)
    repeat = DraftContext(req_id="r", tokens=[1, 2, 3, 4, 8, 1, 2, 3], seed=0)
    assert hybrid.propose(repeat, 2) == Draft([4, 8])  # no confidences from a lookup
    short = DraftContext(req_id="s", tokens=[1, 2, 3, 4, 8, 2, 3], seed=0)  # only a 2-gram repeats
    assert hybrid.propose(short, 2) == Draft([99, 99], [0.9, 0.9])
    assert hybrid.layout == HiddenLayout((1,), 4)  # the model's: the target sends what it reads
