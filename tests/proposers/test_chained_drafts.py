"""Chained drafts (hybrid_chain, --hybrid-chain; proposers/hybrid.py, draft_model.py): a row's
lookup, then the draft model's tokens after it, in one round.

Layers: the rule that makes mixing exact, that a deterministic position reported as a one-hot
row is verified exactly as a proposal with draft_probs None (token-wise, bit for bit); the
chained proposal on a tiny real model (each row's prefix fed, reported as point masses, the
model's first distribution after it a fresh forward's; a seeded row racing at its round
positions; the cache after every kind of acceptance); greedy equality and seeded sampling
equal to plain decoding on fixture chains and on the demo pair, with chained rounds shown to
occur; the output law at temperature > 0 by the G-test harness (tests/helpers/law_checks.py)
under both rules, with prompt lookup and the suffix drafter, and a negative control that must
fail: lookup positions verified with a p/q ratio of a distribution they were not drawn from;
bad settings (ConfigError naming them, exit 2 in the CLI).

Legend: B batch, K draft tokens, V vocabulary.
"""

from __future__ import annotations

import json

import pytest
import torch

import verispec
from verispec import (
    Engine,
    GenerationConfig,
    MarkovLM,
    NgramDraft,
    SamplingConfig,
    SuffixDraft,
    cli,
)
from verispec.errors import ConfigError
from verispec.proposers import DraftModelProposer, HybridProposer
from verispec.proposers.base import DraftPlan, Proposal
from verispec.proposers.hybrid import lookup_named
from verispec.sample.rejection import point_mass, verify_rows
from verispec.sample.sampling import make_generator, to_probs
from verispec.sample.seeded import RaceClocks, stream_key
from verispec.server.settings import ServerSettings
from verispec.text.assemble import wrap_model
from verispec.text.demo import heldout_prompts

from law_checks import (
    VOCAB_SIZE,
    _assert_control_rejected,
    _assert_target_law,
    _proposer_law,
)
from tiny_models import tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread_torch")

VOCAB = 97
T1 = SamplingConfig(temperature=1.0)
GREEDY = SamplingConfig(temperature=0.0)


# --- the rule: a one-hot row is a point mass ---------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_one_hot_rows_verify_as_a_deterministic_proposal(seed):
    generator = make_generator(seed)
    batch, k, vocab = 6, 4, 11
    target_probs = torch.softmax(3 * torch.randn(batch, k + 1, vocab, generator=generator), -1)
    draft_tokens = torch.randint(vocab, (batch, k), generator=generator)
    num_draft = [4, 0, 2, 4, 1, 3]  # ragged rows
    for rows in (range(batch), [2]):  # the host path and a single row
        rows = list(rows)
        args = (draft_tokens[rows], target_probs[rows])
        counts = [num_draft[b] for b in rows]
        none = verify_rows(args[0], None, args[1], make_generator(100 + seed), counts)
        one_hot = verify_rows(args[0], point_mass(args[0], vocab), args[1],
                              make_generator(100 + seed), counts)
        assert none == one_hot


# --- the chained proposal on a tiny real model ---------------------------------------------


@pytest.fixture(scope="module")
def draft_model():
    return tiny_llama(VOCAB, seed=21, hidden=32, layers=2)


def fresh_probs(model, rows: list[list[int]]) -> torch.Tensor:
    """The T = 1 next-token distribution after each row, one full forward a row. -> [B, V]"""
    with torch.inference_mode():
        return torch.stack([to_probs(model(torch.tensor([row])).logits[0, -1], T1)
                            for row in rows])


COMMITTED = [[3, 14, 15, 9], [2, 6], [5, 3, 5, 8, 9, 7]]
PREFIXES = [[40, 41], [], [50, 51, 52]]  # row 2's fills its k = 3: the model draws nothing for it


def _plan(k: int, seed: int, keyed=None) -> DraftPlan:
    generator = make_generator(seed)
    return DraftPlan([k] * 3, [T1] * 3, [generator] * 3, keyed)


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_each_row_proposes_its_prefix_then_the_models_tokens_after_it(draft_model, backend):
    session = DraftModelProposer(wrap_model(draft_model, VOCAB, backend)).start(COMMITTED)
    proposal = session.propose_after(_plan(3, 0), PREFIXES)
    tokens, probs = proposal.draft_tokens.tolist(), proposal.draft_probs
    assert proposal.num_proposed == [3, 3, 3] and probs.shape == (3, 3, VOCAB)
    for b, prefix in enumerate(PREFIXES):
        assert tokens[b][: len(prefix)] == prefix
        torch.testing.assert_close(probs[b, : len(prefix)],
                                   point_mass(torch.tensor(prefix, dtype=torch.int64), VOCAB))
    # the model's first token of each row that draws continues the row's prefix
    expected = fresh_probs(draft_model, [COMMITTED[0] + PREFIXES[0], COMMITTED[1]])
    torch.testing.assert_close(torch.stack([probs[0, 2], probs[1, 0]]), expected,
                               atol=1e-5, rtol=1e-4)
    expected = fresh_probs(draft_model, [COMMITTED[1] + tokens[1][:1]])
    torch.testing.assert_close(probs[1, 1][None], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["fast", "transformers"])
@pytest.mark.parametrize("num_accepted", [[0, 0, 0], [1, 2, 3], [2, 3, 1], [3, 3, 3]])
def test_after_a_chained_round_the_draft_continues_the_committed_sequence(
        draft_model, backend, num_accepted):
    # kept within the prefix, up to its end, into the model's tokens, all (bonus)
    session = DraftModelProposer(wrap_model(draft_model, VOCAB, backend)).start(COMMITTED)
    proposal = session.propose_after(_plan(3, 1), PREFIXES)
    drafted, next_tokens = proposal.draft_tokens.tolist(), [60, 61, 62]
    session.commit(num_accepted, next_tokens)
    committed = [row + d[:n] + [t] for row, d, n, t
                 in zip(COMMITTED, drafted, num_accepted, next_tokens)]
    after = session.propose(_plan(2, 2))
    torch.testing.assert_close(after.draft_probs[:, 0], fresh_probs(draft_model, committed),
                               atol=1e-5, rtol=1e-4)


class _RecordedClocks:
    """A seeded row's clocks (engine.rows.Row.clocks), recording the positions asked."""

    def __init__(self, seed: int) -> None:
        self.key, self.positions = stream_key(seed), []

    def clocks(self, step: int, vocab_size: int) -> RaceClocks:
        self.positions.append(step)
        return RaceClocks(self.key, step, vocab_size)


def test_a_seeded_row_races_at_its_round_positions_after_its_prefix(draft_model):
    # the draft's race must use the clocks the target's race will use at that position
    keyed = [_RecordedClocks(seed) for seed in (1, 2, 3)]
    session = DraftModelProposer(wrap_model(draft_model, VOCAB, "fast")).start(COMMITTED)
    session.propose_after(_plan(4, 0, keyed), PREFIXES)
    assert [clocks.positions for clocks in keyed] == [[2, 3], [0, 1, 2, 3], [3]]


# --- greedy and seeded equality with plain decoding --------------------------------------


def _markov(seed: int, sharpness: float = 2.0) -> MarkovLM:
    return MarkovLM.random(VOCAB_SIZE, make_generator(seed), order=1, sharpness=sharpness)


class _Counting(HybridProposer):
    """The real proposer, keeping its sessions so a test can see which kinds of round ran."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sessions = []

    def start(self, prompts):
        session = super().start(prompts)
        self.sessions.append(session)
        return session

    def rounds(self, kind: str) -> int:
        return sum(getattr(session, f"num_{kind}_rounds") for session in self.sessions)


LOOKUPS = {"ngram": NgramDraft(min_ngram=1, max_ngram=3),
           "suffix": SuffixDraft(min_match=1, max_match=4, first_depth=2, factor=2.0,
                                 min_confidence=0.3, pool_tokens=0)}
PROMPTS = [[3, 5, 2, 3, 5, 2, 3], [1], [7, 7, 2, 0, 7, 7, 2]]  # batch 3, ragged matches


@pytest.mark.parametrize("lookup", sorted(LOOKUPS))
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_equals_plain_decoding_with_chained_rounds(lookup, k):
    proposer = _Counting(DraftModelProposer(_markov(5, 1.0)), LOOKUPS[lookup], chain=True)
    decoder = Engine(_markov(3), proposer)
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=k, sampling=GREEDY)
    speculative = decoder.generate(PROMPTS, config)
    assert speculative.token_ids == decoder.generate(PROMPTS, config, speculative=False).token_ids
    for prompt, expected in zip(PROMPTS, speculative.token_ids):  # batch 1 too
        assert decoder.generate([prompt], config).token_ids == [expected]
    if k > 1:  # k = 1: a lookup of one token fills the round
        assert proposer.rounds("chained") > 0 and proposer.rounds("draft") > 0


@pytest.mark.parametrize("lookup", sorted(LOOKUPS))
def test_seeded_sampling_gives_the_text_of_plain_decoding_with_chained_rounds(lookup):
    proposer = _Counting(DraftModelProposer(_markov(5, 1.0), draft_p_min=0.4),
                         LOOKUPS[lookup], chain=True)
    decoder = Engine(_markov(3, 1.0), proposer)
    config = GenerationConfig(max_new_tokens=30, num_draft_tokens=4, seed=11,
                              sampling=SamplingConfig(temperature=0.7))
    speculative = decoder.generate(PROMPTS, config)
    assert speculative.token_ids == decoder.generate(PROMPTS, config, speculative=False).token_ids
    assert proposer.rounds("chained") > 0


DEMO_PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef add(a, b):"] + [
    prompt for prompt in heldout_prompts() if len(prompt) <= 160][:2]


@pytest.mark.parametrize("lookup, draft_p_min", [("ngram", 0.0), ("suffix", 0.5)])
def test_demo_pair_greedy_and_seeded_equal_plain_decoding(lookup, draft_p_min):
    decoder = verispec.load(hybrid=lookup_named(lookup), hybrid_chain=True,
                            draft_p_min=draft_p_min)
    assert decoder.engine.proposer.chain and decoder.hybrid == lookup_named(lookup)
    for k in (2, 6):
        for settings in ({"temperature": 0.0}, {"temperature": 0.7, "seed": 5}):
            outs = decoder.generate(DEMO_PROMPTS, max_new_tokens=40, num_draft_tokens=k,
                                    **settings)
            plain = decoder.generate(DEMO_PROMPTS, max_new_tokens=40, speculative=False,
                                     **settings)
            assert [o.token_ids for o in outs] == [o.token_ids for o in plain], (k, settings)
            assert sum(o.metrics.num_drafted for o in outs) > 0


# --- the output law at temperature > 0 --------------------------------------------------------

# [3] last occurred at position 2, followed by 5 2 3: a 3-token lookup (both lookups), so at
# k = 4 the first round is chained: three point masses, then one draft-model token
LAW_PROMPT = [3, 5, 3, 5, 2, 3]
LAW_LOOKUPS = {"ngram": NgramDraft(min_ngram=1, max_ngram=3),
               # in a batch of N rows a match must be N times min_match, up to max_match
               "suffix": SuffixDraft(min_match=1, max_match=1, factor=3.0, pool_tokens=0)}


def _chained_law(lookup: str, k: int, temperature: float, seed: int, verification: str,
                 proposer_type=None):
    proposer = (proposer_type or _Counting)(DraftModelProposer(_markov(12, 1.5)),
                                            LAW_LOOKUPS[lookup], chain=True)
    results, metrics = _proposer_law(_markov(11, 1.5), proposer, k, temperature, seed,
                                     LAW_PROMPT, verification)
    return results, metrics, proposer


@pytest.mark.slow
@pytest.mark.parametrize("lookup, k, temperature, verification, seed", [
    ("ngram", 4, 1.0, "block", 52_001), ("ngram", 4, 1.0, "token", 52_002),
    ("ngram", 6, 0.7, "block", 52_003), ("suffix", 4, 1.0, "token", 52_004),
    ("suffix", 5, 1.0, "block", 52_005)])
def test_sampled_output_has_the_target_law(lookup, k, temperature, verification, seed):
    results, metrics, proposer = _chained_law(lookup, k, temperature, seed, verification)
    assert proposer.rounds("chained") >= 1  # the first round at least
    assert 0 < metrics.num_accepted < metrics.num_drafted
    _assert_target_law(f"chained {lookup} k={k} T={temperature} {verification}", results)


class _RatioOnLookups(_Counting):
    """Negative control: the lookup's positions reported as uniform draws (q = 1/V), so they
    are verified with a p/q ratio instead of as point masses."""

    def start(self, prompts):
        session = super().start(prompts)
        propose = session.propose

        def uniform_lookups(plan, constraint=None):
            proposal = propose(plan, constraint)
            probs = proposal.draft_probs
            if probs is None:
                return proposal
            point = probs.amax(dim=-1, keepdim=True) == 1.0  # [B, K, 1]: a lookup's position
            probs = torch.where(point, torch.full_like(probs, 1 / probs.shape[-1]), probs)
            return Proposal(proposal.draft_tokens, probs, proposal.num_proposed)

        session.propose = uniform_lookups
        return session


@pytest.mark.slow
def test_lookup_positions_verified_with_a_ratio_are_rejected():
    results, _, proposer = _chained_law("ngram", 4, 1.0, 52_100, "token", _RatioOnLookups)
    assert proposer.rounds("chained") >= 1
    _assert_control_rejected("lookups verified with a p/q ratio", results)


# --- bad settings -------------------------------------------------------------------------------


def test_bad_chain_settings_raise_a_config_error_naming_them():
    with pytest.raises(ConfigError, match="pass hybrid=True"):
        verispec.load(hybrid_chain=True)
    with pytest.raises(ConfigError, match=r"^hybrid_chain='yes' is invalid"):
        verispec.load(hybrid=True, hybrid_chain="yes")
    with pytest.raises(ConfigError, match=r"^hybrid_lookup='trie' is invalid"):
        lookup_named("trie")
    with pytest.raises(ConfigError, match=r"^hybrid_lookup='trie' is invalid"):
        ServerSettings(hybrid=True, hybrid_lookup="trie")
    with pytest.raises(ConfigError, match="pass --hybrid as well"):
        ServerSettings(hybrid_chain=True)


@pytest.mark.parametrize("extra, fragment", [
    (["--hybrid-chain"], "--hybrid-chain sets how --hybrid drafts"),
    (["--hybrid-lookup", "suffix"], "--hybrid-lookup sets how --hybrid drafts"),
    (["--hybrid", "--hybrid-lookup", "trie"], "argument --hybrid-lookup: invalid choice"),
])
def test_cli_bad_chain_flags_exit_2_with_one_line(capsys, extra, fragment):
    try:
        status = cli.main(["generate", "x", *extra])
    except SystemExit as exc:  # argparse's own refusals (not a choice)
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err


def test_cli_chained_hybrid_equals_no_draft(capsys):
    args = ["generate", DEMO_PROMPTS[0], "--temperature", "0", "--max-new-tokens", "30",
            "--json"]
    assert cli.main(args + ["--hybrid", "--hybrid-lookup", "suffix", "--hybrid-chain",
                            "--draft-p-min", "0.5", "--k", "4"]) == 0
    chained = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--no-draft"]) == 0
    assert chained["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    assert chained["metrics"]["num_drafted"] > 0


def test_serve_flags_reach_the_settings_and_the_decoder():
    args = cli.build_parser().parse_args(["serve", "--hybrid", "--hybrid-lookup", "suffix",
                                          "--hybrid-chain", "--draft-p-min", "0.75"])
    settings = ServerSettings.from_args(args)
    assert (settings.hybrid_lookup, settings.hybrid_chain, settings.draft_p_min) == (
        "suffix", True, 0.75)
    from verispec.server.run import load_decoder

    proposer = load_decoder(settings).engine.proposer  # the demo pair
    assert isinstance(proposer.config, SuffixDraft) and proposer.chain
    assert proposer.draft.draft_p_min == 0.75
