from foresight.drafter_worker.ngram import lookup


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
