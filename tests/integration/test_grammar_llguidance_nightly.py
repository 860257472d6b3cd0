"""The full set of test_grammar_llguidance's comparison with llguidance
(label nightly: about 2 minutes, longer than CI's share for it): 40 random
walks per constraint instead of 12, over 20,000 (constraint, prefix)
points on each vocabulary, the default model's and Qwen2's. Same bars:
every differing token in a listed category, at most 0.5% of the points."""

import test_grammar_llguidance as oracle
from test_grammar_llguidance import vocab  # noqa: F401 (the fixture)

WALKS = 40


def test_masks_equal_llguidance_full(tandem_bin, vocab, tmp_path):  # noqa: F811
    points = oracle.compare_masks(tandem_bin, vocab, tmp_path, WALKS)
    assert points >= 10000, points
