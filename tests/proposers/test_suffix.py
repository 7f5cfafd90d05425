"""proposers/suffix.py: suffix-decoding drafts, their matching and confidence rules, the shared
pool of finished sequences, and exactness through the engine.

Two layers here: the drafting rules on hand-made sequences; greedy equality with plain decoding
on the shipped demo pair, with drafts that are really proposed and accepted (from the rows' own
histories and, in later generations, from the pool).
"""

from __future__ import annotations

import pytest

from verispec import Engine, GenerationConfig, SamplingConfig
from verispec.errors import ConfigError
from verispec.proposers.base import DraftPlan
from verispec.proposers.suffix import MAX_OCCURRENCES, SuffixDraft, SuffixProposer
from verispec.sample.sampling import make_generator

pytestmark = pytest.mark.usefixtures("single_thread_torch")

GREEDY = SamplingConfig(temperature=0)
SPAN = list(range(10, 30))  # 20 distinct tokens


# the unit cases are written for short matches (2 tokens); the default asks for longer ones
SHORT = SuffixDraft(min_match=2, first_depth=32)


def _session(prompts, config=None, proposer=None):
    return (proposer or SuffixProposer(100, config or SHORT)).start(prompts)


def _proposed(session, k):
    proposal = session.propose(DraftPlan.uniform(len(session.rows), k, GREEDY,
                                                  make_generator(0)))
    assert proposal.draft_probs is None  # deterministic: verified as a point mass
    tokens = proposal.draft_tokens.tolist()
    assert proposal.draft_tokens.shape == (len(session.rows), max(proposal.num_proposed))
    return [row[:n] for row, n in zip(tokens, proposal.num_proposed)]


# --- matching and drafting -------------------------------------------------------------------


def test_no_draft_below_min_match():
    # (1,) repeats, (3, 1) does not: m = 1
    assert _proposed(_session([[1, 2, 3, 1]]), 4) == [[]]
    assert _proposed(_session([[1, 2, 3, 1]], SuffixDraft(min_match=1)), 4) == [[2]]
    assert _proposed(_session([[1, 2, 3, 4]], SuffixDraft(min_match=1)), 4) == [[]]


def test_a_long_repeat_drafts_up_to_k_and_match_times_factor():
    prompt = SPAN + SPAN[:6]  # the suffix SPAN[:6] matched: m = 6
    assert _proposed(_session([prompt]), 8) == [SPAN[6:12]]  # m * factor = 6 < k
    assert _proposed(_session([prompt]), 4) == [SPAN[6:10]]  # k < 6
    def proposed(**settings):
        return _proposed(_session([prompt], SuffixDraft(min_match=2, **settings)), 8)

    assert proposed(first_depth=32, factor=0.5) == [SPAN[6:9]]
    assert proposed(first_depth=2, max_depth=2) == [SPAN[6:8]]
    assert proposed(first_depth=32, max_match=4) == [SPAN[6:10]]


def test_a_match_is_the_longest_suffix_up_to_max_match():
    prompt = SPAN * 2 + SPAN[:1]  # the suffix SPAN + SPAN[:1] occurred before: m = 21
    # the occurrence runs into the present, then continues with the draft; m caps it at 21
    assert _proposed(_session([prompt]), 32) == [SPAN[1:] + SPAN[:2]]
    capped = _session([prompt], SuffixDraft(min_match=2, first_depth=32, max_match=8))
    assert _proposed(capped, 32) == [SPAN[1:9]]


def test_a_loop_drafts_on_around_itself():
    # the only occurrence of (7,) * 9 runs into the present: it continues with the draft
    assert _proposed(_session([[7] * 10]), 8) == [[7] * 8]


def test_the_confident_path_stops_where_occurrences_diverge():
    # (1, 2, 3) occurred three times, each followed by 4, then by 5, 6 and 7
    history = [90, 1, 2, 3, 4, 5, 91, 1, 2, 3, 4, 6, 92, 1, 2, 3, 4, 7, 93, 1, 2, 3]
    assert _proposed(_session([history]), 8) == [[4]]  # 5, 6, 7: 1/3 each < 0.5
    # at 1/3 the path goes on; a tie goes to the most recent occurrence (then m = 3 caps it)
    confident = SuffixDraft(min_match=2, first_depth=32, min_confidence=0.3)
    assert _proposed(_session([history], confident), 8) == [[4, 7, 93]]
    # min_confidence 1: a path every occurrence shares
    certain = SuffixDraft(min_match=2, first_depth=32, min_confidence=1.0)
    assert _proposed(_session([history], certain), 8) == [[4]]


def test_the_most_frequent_continuation_beats_the_most_recent():
    history = [90, 1, 2, 8, 91, 1, 2, 8, 92, 1, 2, 9, 93, 1, 2]
    assert _proposed(_session([history]), 1) == [[8]]  # 2 of 3 occurrences
    history = [90, 1, 2, 8, 91, 1, 2, 9, 93, 1, 2]
    assert _proposed(_session([history]), 1) == [[9]]  # 1 of 2 each: the most recent


def test_frequencies_count_the_latest_occurrences_only():
    old, new = [90, 1, 2, 8] * (MAX_OCCURRENCES + 1), [91, 1, 2, 9] * MAX_OCCURRENCES
    assert _proposed(_session([old + new + [1, 2]]), 1) == [[9]]


def test_ragged_rows_are_padded_and_no_draft_is_a_plain_round():
    # min_match 1: in a round of 3 rows a draft needs a match 3 times as long (3 tokens here)
    session = _session([SPAN + SPAN[:3], [1, 2, 3], [7] * 4],
                       SuffixDraft(min_match=1, first_depth=32))
    proposal = session.propose(DraftPlan.uniform(3, 4, GREEDY, make_generator(0)))
    assert proposal.num_proposed == [3, 0, 3]
    assert proposal.draft_tokens.tolist() == [SPAN[3:6], [3] * 3, [7] * 3]
    nothing = _session([[1, 2, 3], [4, 5]]).propose(DraftPlan.uniform(2, 4, GREEDY,
                                                                      make_generator(0)))
    assert nothing.draft_tokens.shape == (2, 0) and nothing.num_proposed == [0, 0]


def test_a_row_with_k_zero_drafts_nothing():
    session = _session([SPAN + SPAN[:3], SPAN + SPAN[:3]], SuffixDraft(min_match=1))
    plan = DraftPlan([0, 2], [GREEDY] * 2, [make_generator(0)] * 2)
    assert session.propose(plan).num_proposed == [0, 2]


def test_commit_appends_accepted_tokens_and_the_next_one_to_the_history():
    session = _session([SPAN + SPAN[:4]])
    assert _proposed(session, 3) == [SPAN[4:7]]
    session.commit([2], [99])  # kept SPAN[4:6], then 99
    assert session.rows[0].tokens == SPAN + SPAN[:6] + [99]
    assert _proposed(session, 3) == [[]]  # (SPAN[5], 99) is new
    session.commit([0], [5])  # a round without a draft: only the next token
    assert session.rows[0].tokens[-2:] == [99, 5]
    session.append_committed([[12, 13, 14]])  # as in a round another proposer drafted
    assert _proposed(session, 1) == [[15]]  # (12, 13, 14) occurred twice, followed by 15


def test_keep_rows_and_add_rows_keep_rows_aligned():
    # min_match 1: in a round of 3 rows a draft needs a 3-token match
    session = _session([SPAN[:5] * 2 + SPAN[:2], [7] * 3, [40, 41, 42, 43, 40, 41, 42]],
                       SuffixDraft(min_match=1, first_depth=32, pool_tokens=0))
    session.keep_rows([2, 0])
    session.add_rows([[50, 51, 52, 53, 50, 51, 52]], defer=True)
    assert _proposed(session, 2) == [[43, 40], SPAN[2:4], [53, 50]]
    session.commit([1, 0, 2], [60, 61, 62])
    assert [row.tokens[-3:] for row in session.rows] == [[42, 43, 60], [10, 11, 61],
                                                          [53, 50, 62]]


# --- the pool -----------------------------------------------------------------------------


def test_a_later_session_drafts_what_only_a_finished_session_output():
    proposer = SuffixProposer(100, SHORT)
    first = proposer.start([[1, 2, 3]])
    first.append_committed([[70, 71, 72, 73, 74, 75, 76]])  # its output
    assert _proposed(_session([[5, 70, 71, 72]], proposer=proposer), 8) == [[]]  # not yet
    first.keep_rows([])  # the row leaves: prompt and output enter the pool
    assert _proposed(_session([[5, 70, 71, 72]], proposer=proposer), 8) == [[73, 74, 75]]
    assert _proposed(_session([[2, 3, 70]], proposer=proposer), 8) == [[71, 72, 73]]


def test_close_pools_the_rows_still_there():
    proposer = SuffixProposer(100, SHORT)
    session = proposer.start([[60, 61, 62, 63, 64, 65]])
    session.close()
    assert session.rows == [] and proposer.pool.num_tokens == 6
    assert _proposed(_session([[0, 61, 62]], proposer=proposer), 8) == [[63, 64]]


def test_the_rows_own_history_wins_at_equal_length_and_a_longer_pool_match_wins():
    proposer = SuffixProposer(100, SHORT)
    proposer.start([[4, 5, 6, 8, 0, 0]]).close()
    # own (5, 6) -> 7 against pooled (5, 6) -> 8: equal lengths, the row's own
    assert _proposed(_session([[5, 6, 7, 1, 5, 6]], proposer=proposer), 1) == [[7]]
    # own (5, 6) -> 7 against pooled (4, 5, 6) -> 8: the longer
    assert _proposed(_session([[5, 6, 7, 4, 5, 6]], proposer=proposer), 1) == [[8]]


def test_no_match_crosses_from_one_pooled_sequence_into_the_next():
    proposer = SuffixProposer(100, SHORT)
    proposer.start([[30, 31, 32], [33, 34, 35]]).close()
    assert _proposed(_session([[0, 31, 32]], proposer=proposer), 4) == [[]]
    assert _proposed(_session([[0, 32, 33]], proposer=proposer), 4) == [[]]


def test_the_pool_bound_evicts_the_oldest_sequences():
    proposer = SuffixProposer(100, SuffixDraft(min_match=2, first_depth=32, pool_tokens=10))
    proposer.start([[20, 21, 22, 23, 24, 25]]).close()
    proposer.start([[40, 41, 42, 43, 44, 45]]).close()  # 12 tokens: the first leaves
    assert proposer.pool.num_tokens == 6
    assert _proposed(_session([[0, 20, 21]], proposer=proposer), 4) == [[]]
    assert _proposed(_session([[0, 40, 41]], proposer=proposer), 4) == [[42, 43]]
    for start in range(50, 90, 5):  # enough evictions to rebuild the index
        proposer.start([list(range(start, start + 5))]).close()
    assert proposer.pool.num_tokens == 10
    assert _proposed(_session([[0, 80, 81]], proposer=proposer), 4) == [[82, 83]]
    assert _proposed(_session([[0, 75, 76]], proposer=proposer), 4) == [[]]
    proposer.start([list(range(30))]).close()  # longer than the bound: its last 10 tokens
    assert _proposed(_session([[0, 20, 21]], proposer=proposer), 4) == [[22, 23]]
    assert _proposed(_session([[0, 18, 19]], proposer=proposer), 4) == [[]]


def test_pool_tokens_zero_keeps_no_pool():
    proposer = SuffixProposer(100, SuffixDraft(min_match=2, first_depth=32, pool_tokens=0))
    proposer.start([[60, 61, 62, 63]]).close()
    assert proposer.pool is None
    assert _proposed(_session([[0, 61, 62]], proposer=proposer), 4) == [[]]


@pytest.mark.parametrize("kwargs, fragment", [
    ({"max_depth": 0}, "max_depth=0"), ({"max_depth": 2.0}, "max_depth=2.0"),
    ({"factor": 0}, "factor=0"), ({"factor": float("inf")}, "factor=inf"),
    ({"min_match": 0}, "min_match=0"), ({"min_match": 5, "max_match": 4}, "min_match=5"),
    ({"max_match": 65}, "max_match=65"), ({"min_match": True}, "min_match=True"),
    ({"min_confidence": 1.5}, "min_confidence=1.5"), ({"pool_tokens": -1}, "pool_tokens=-1"),
])
def test_bad_suffix_config(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        SuffixDraft(**kwargs)


# --- greedy on the demo pair: token-for-token equality with plain decoding --------------------


REPETITIVE_PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in",
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\nw =",
]


@pytest.fixture(scope="module")
def demo_prompts(demo_decoder):
    return [demo_decoder.tokenizer.encode(prompt) for prompt in REPETITIVE_PROMPTS]


@pytest.fixture(scope="module")
def demo_plain(demo_decoder, demo_prompts):
    config = GenerationConfig(max_new_tokens=40, sampling=GREEDY)
    return demo_decoder.engine.generate(demo_prompts, config, speculative=False).token_ids


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_equals_plain_decoding_on_the_demo_pair(demo_decoder, demo_prompts,
                                                               demo_plain, k):
    target = demo_decoder.target
    proposer = SuffixProposer(target.vocab_size, SuffixDraft())
    decoder = Engine(target, proposer)
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=k, sampling=GREEDY)
    speculative = decoder.generate(demo_prompts, config)  # batch 3, the rows' own histories
    assert speculative.token_ids == demo_plain
    metrics = speculative.metrics
    assert metrics.num_drafted > 0 and metrics.num_accepted > 0
    assert proposer.pool.num_tokens == sum(map(len, demo_prompts)) + sum(map(len, demo_plain))
    for prompt, expected in zip(demo_prompts, demo_plain):  # batch 1, with the pool
        alone = decoder.generate([prompt], config)
        assert alone.token_ids == [expected]
        assert alone.metrics.num_accepted > 0 and alone.metrics.num_rounds < len(expected)


def test_a_kept_draft_doubles_the_next_and_a_rejected_one_asks_a_longer_match():
    span = list(range(10, 60))
    session = _session([span + [0] + span[:6]], SuffixDraft(min_match=2, first_depth=4))
    assert _proposed(session, 32) == [span[6:10]]  # the first draft: first_depth tokens
    session.commit([4], [span[10]])  # kept whole
    assert _proposed(session, 32) == [span[11:19]]  # twice as deep
    session.commit([0], [99])  # rejected at its first token: the text left the span
    row = session.rows[0]
    assert (row.needed, row.budget) == (4, 4)
    session.append_committed([[span[0], span[1]]])  # a 2-token match no longer drafts
    assert _proposed(session, 32) == [[]]


def test_in_a_batch_a_draft_needs_a_match_as_many_times_as_long_as_rows():
    alone = _session([SPAN + SPAN[:4]], SuffixDraft(min_match=2, first_depth=32))
    assert _proposed(alone, 4) == [SPAN[4:8]]  # 4 >= 2: drafts alone
    pair = _session([SPAN + SPAN[:4], SPAN + SPAN[:6]], SuffixDraft(min_match=3, first_depth=32))
    assert _proposed(pair, 4) == [[], SPAN[6:10]]  # 2 rows: a match of 6 or more
