"""The draft-model proposer's cache bookkeeping (proposers/draft_model.py).

Verification keeps the output exact whatever the draft proposes, so a draft cache that drifts
from the committed sequence would not show up in the output, only as lost acceptance. These
tests pin the bookkeeping itself: after any commit, the draft's next distribution must be the one
a fresh forward over the committed sequence gives.
"""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingConfig
from verispec.proposers.base import DraftPlan
from verispec.proposers.draft_model import DraftModelProposer
from verispec.sample.sampling import to_probs
from verispec.text.assemble import wrap_model

from tiny_models import tiny_llama

VOCAB = 97
SAMPLING = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def draft_model():
    return tiny_llama(VOCAB, seed=21, hidden=32, layers=2)


def fresh_probs(model, rows: list[list[int]]) -> torch.Tensor:
    """The next-token distribution after each row, from one full forward per row. -> [B, V]"""
    with torch.inference_mode():
        return torch.stack([to_probs(model(torch.tensor([row])).logits[0, -1], SAMPLING)
                            for row in rows])


@pytest.mark.parametrize("backend", ["fast", "transformers"])
@pytest.mark.parametrize("k", [1, 3])
def test_after_every_commit_the_draft_continues_the_committed_sequence(draft_model, backend, k):
    # rounds of ragged acceptance across 3 rows: none, some and all of the k drafts accepted,
    # so rows carry 1 or 2 unfed tokens into the next round, in every mix
    proposer = DraftModelProposer(wrap_model(draft_model, VOCAB, backend))
    committed = [[3, 14, 15, 9], [2, 6], [5, 3, 5, 8, 9, 7]]
    session = proposer.start(committed)
    generator = torch.Generator().manual_seed(0)
    patterns = [[0, min(1, k), k], [k, k, 0], [k // 2, 0, k], [k, k, k]]
    for round_index, num_accepted in enumerate(patterns):
        proposal = session.propose(DraftPlan.uniform(3, k, SAMPLING, generator))
        # the first drafted distribution continues the committed sequence exactly
        torch.testing.assert_close(proposal.draft_probs[:, 0], fresh_probs(draft_model, committed),
                                   atol=1e-5, rtol=1e-4)
        drafted = proposal.draft_tokens.tolist()
        next_tokens = [(11 * round_index + row) % VOCAB for row in range(3)]
        session.commit(num_accepted, next_tokens)
        committed = [row + d[:n] + [t] for row, d, n, t
                     in zip(committed, drafted, num_accepted, next_tokens)]
    final = session.propose(DraftPlan.uniform(3, 1, SAMPLING, generator))
    torch.testing.assert_close(final.draft_probs[:, 0], fresh_probs(draft_model, committed),
                               atol=1e-5, rtol=1e-4)


def test_a_rejected_round_leaves_one_token_to_feed_and_a_full_one_two(draft_model):
    proposer = DraftModelProposer(wrap_model(draft_model, VOCAB, "fast"))
    session = proposer.start([[3, 14, 15], [2, 6, 5]])
    proposal = session.propose(DraftPlan.uniform(2, 3, SamplingConfig(temperature=0.0),
                                                 torch.Generator()))
    assert proposal.draft_probs is None  # greedy: a point mass, verified as such
    drafted = proposal.draft_tokens.tolist()
    session.commit([1, 3], [40, 41])
    # row 0 accepted d1 (already in the cache) and needs only its recovered token fed; row 1
    # accepted all three, and d3 (sampled, never fed) comes before its bonus token
    assert session.unfed == [[40], [drafted[1][2], 41]]
    assert session.session.lengths == [3 + 1, 3 + 2]


@pytest.mark.parametrize("catch_up", [False, True])
@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_rows_joining_with_deferred_work_continue_their_sequence_at_the_next_proposal(
        draft_model, backend, catch_up):
    # rows joining a batch that runs plain rounds (defer=True) hold their prompts as unfed
    # tokens; after more plain rounds, the next proposal (or catch_up before it) feeds them,
    # beside a row that joined eagerly, and every row's draft continues its committed sequence
    proposer = DraftModelProposer(wrap_model(draft_model, VOCAB, backend))
    committed = [[3, 14, 15, 9]]
    session = proposer.start(committed)
    joining = [[2, 6], [5, 3, 5, 8, 9, 7, 9, 3], [4]]
    session.add_rows(joining, defer=True)
    assert [int(n) for n in session.session.lengths][1:] == [0, 0, 0]
    assert session.unfed[1:] == joining
    committed += [list(p) for p in joining]
    for round_index in range(3):  # plain rounds: no proposal, one committed token per row
        next_tokens = [(7 * round_index + row) % VOCAB for row in range(4)]
        session.commit([0] * 4, next_tokens)
        committed = [row + [t] for row, t in zip(committed, next_tokens)]
    session.add_rows([[8, 1, 2]])  # an eager join
    committed.append([8, 1, 2])
    if catch_up:  # all but each row's last token fed: the proposal's first step feeds one
        session.catch_up()
        assert session.unfed == [row[-1:] for row in committed]
        assert [int(n) for n in session.session.lengths] == [len(row) - 1 for row in committed]
    generator = torch.Generator().manual_seed(0)
    proposal = session.propose(DraftPlan.uniform(5, 2, SAMPLING, generator))
    torch.testing.assert_close(proposal.draft_probs[:, 0], fresh_probs(draft_model, committed),
                               atol=1e-5, rtol=1e-4)
    assert [int(n) for n in session.session.lengths] == [len(row) + 1 for row in committed]
