"""The draft model's confidence stop (draft_p_min, --draft-p-min; proposers/draft_model.py).

A row's draft ends before the first position whose draft distribution has a largest probability
below the floor (a greedy row's at temperature 1). Four layers: the stop itself on a tiny real
model against a floor-free proposal with the same random numbers (ragged rows, mixed greedy and
sampled, a batch where no row proposes anything) and the draft cache after stopped rounds
against a fresh forward; greedy equality with plain decoding and seeded sampling equal to
seeded plain decoding on fixture Markov chains and on the demo pair; the output law at
temperature > 0 by the G-test harness (tests/helpers/law_checks.py), under both rules, with a
negative control that must fail: the stop decided on the drawn token's own probability, which
makes the proposed token a draw from a truncated distribution while it is verified with the
full one; and bad values of the setting (ConfigError naming it, exit 2 in the CLI).

Legend: B batch, K draft tokens, V vocabulary.
"""

from __future__ import annotations

import math

import pytest
import torch

import verispec
from verispec import Engine, GenerationConfig, MarkovLM, SamplingConfig, cli
from verispec.errors import ConfigError
from verispec.proposers import DraftModelProposer
from verispec.proposers.base import DraftPlan, Proposal
from verispec.sample.sampling import make_generator, to_probs
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


@pytest.fixture(scope="module")
def draft_model():
    """A tiny Llama whose logits are scaled up (its final norm's weight times 6): largest
    probabilities of 0.1-0.5 where the initialised model's are ~1/V, so a floor stops some
    positions and not others."""
    model = tiny_llama(VOCAB, seed=21, hidden=32, layers=2)
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)
    return model


def _recording(proposer):
    """``proposer`` with each session's proposals recorded in ``proposer.rounds``: (the depth
    each row was asked, the tokens it proposed)."""
    proposer.rounds = []
    start = proposer.start

    def recorded_start(prompts):
        session = start(prompts)
        propose = session.propose

        def recorded(plan, constraint=None):
            proposal = propose(plan, constraint)
            proposer.rounds.append((list(plan.num_draft_tokens), list(proposal.num_proposed)))
            return proposal

        session.propose = recorded
        return session

    proposer.start = recorded_start
    return proposer


def _stopped_early(proposer) -> bool:
    """Whether some row proposed fewer tokens than it was asked, and some row proposed some."""
    pairs = [(k, n) for asked, proposed in proposer.rounds for k, n in zip(asked, proposed)]
    return any(n < k for k, n in pairs) and any(n > 0 for _, n in pairs)


def fresh_logits(model, rows: list[list[int]]) -> torch.Tensor:
    """The next-token logits after each row, from one full forward per row. -> [B, V]"""
    with torch.inference_mode():
        return torch.stack([model(torch.tensor([row])).logits[0, -1].float() for row in rows])


def _plan(k: int, samplings: list[SamplingConfig], seed: int) -> DraftPlan:
    generator = make_generator(seed)
    return DraftPlan([k] * len(samplings), samplings, [generator] * len(samplings))


# --- the stop itself --------------------------------------------------------------------------


def _confidences(model, committed, proposal: Proposal, samplings) -> list[list[float]]:
    """Per row and position of a floor-free proposal, the draft's largest probability there:
    of its reported probs where the row samples, of a fresh forward at T = 1 where greedy."""
    tokens = proposal.draft_tokens.tolist()
    out = []
    for b, (row, sampling) in enumerate(zip(committed, samplings)):
        if not sampling.is_greedy:
            out.append(proposal.draft_probs[b].amax(dim=-1).tolist())
            continue
        prefixes = [row + tokens[b][:j] for j in range(len(tokens[b]))]
        out.append(to_probs(fresh_logits(model, prefixes), T1).amax(dim=-1).tolist())
    return out


def test_each_row_stops_before_its_first_unsure_position(draft_model):
    # rows 0 and 1 sample at T = 1, row 2 is greedy; the floor is the median confidence, so
    # rows stop at different depths
    committed = [[3, 14, 15, 9], [2, 6], [5, 3, 5, 8, 9, 7]]
    samplings, k = [T1, T1, GREEDY], 6
    model = wrap_model(draft_model, VOCAB, "fast")
    reference = DraftModelProposer(model).start(committed).propose(_plan(k, samplings, 3))
    confidence = _confidences(draft_model, committed, reference, samplings)
    floor = sorted(c for row in confidence for c in row)[len(samplings) * k // 2]
    expected = [next((j for j, c in enumerate(row) if c < floor), k) for row in confidence]
    assert len(set(expected)) > 1 and max(expected) > 0  # ragged: the case is worth testing

    stopped = DraftModelProposer(model, draft_p_min=floor).start(committed).propose(
        _plan(k, samplings, 3))
    assert stopped.num_proposed == expected
    assert stopped.draft_tokens.shape[1] == max(expected)  # as wide as its longest row
    for b, n in enumerate(expected):  # the same draws, cut
        assert stopped.draft_tokens[b, :n].tolist() == reference.draft_tokens[b, :n].tolist()
        if not samplings[b].is_greedy:
            torch.testing.assert_close(stopped.draft_probs[b, :n], reference.draft_probs[b, :n])


def test_a_batch_of_unsure_rows_proposes_nothing_and_keeps_its_cache(draft_model):
    committed = [[3, 14, 15], [2, 6, 5, 1]]
    session = DraftModelProposer(wrap_model(draft_model, VOCAB, "fast"),
                                 draft_p_min=1.0).start(committed)
    proposal = session.propose(_plan(4, [T1, GREEDY], 0))
    assert proposal.num_proposed == [0, 0] and proposal.draft_tokens.shape == (2, 0)
    assert proposal.draft_probs is None
    session.commit([0, 0], [40, 41])
    committed = [row + [token] for row, token in zip(committed, [40, 41])]
    session.draft_p_min = 0.0  # then an ordinary round continues the committed sequence
    proposal = session.propose(_plan(1, [T1, T1], 1))
    torch.testing.assert_close(proposal.draft_probs[:, 0],
                               to_probs(fresh_logits(draft_model, committed), T1),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_after_stopped_rounds_the_draft_continues_the_committed_sequence(draft_model, backend):
    # ragged stops, then none, some or all of each row's proposed tokens kept: the next
    # proposal's first distribution must be a fresh forward's over the committed sequence
    proposer = DraftModelProposer(wrap_model(draft_model, VOCAB, backend), draft_p_min=0.15)
    committed = [[3, 14, 15, 9], [2, 6], [5, 3, 5, 8, 9, 7]]
    session = proposer.start(committed)
    stopped_somewhere = False
    for round_index, share in enumerate([(0, 1, 2), (2, 2, 0), (1, 0, 2), (2, 2, 2)]):
        proposal = session.propose(_plan(5, [T1] * 3, round_index))
        torch.testing.assert_close(proposal.draft_probs[:, 0],
                                   to_probs(fresh_logits(draft_model, committed), T1),
                                   atol=1e-5, rtol=1e-4)
        proposed = proposal.num_proposed
        stopped_somewhere |= min(proposed) < 5
        num_accepted = [n * s // 2 for n, s in zip(proposed, share)]  # none, half or all
        drafted = proposal.draft_tokens.tolist()
        next_tokens = [(11 * round_index + row) % VOCAB for row in range(3)]
        session.commit(num_accepted, next_tokens)
        committed = [row + d[:n] + [t] for row, d, n, t
                     in zip(committed, drafted, num_accepted, next_tokens)]
    assert stopped_somewhere
    final = session.propose(_plan(1, [T1] * 3, 9))
    torch.testing.assert_close(final.draft_probs[:, 0],
                               to_probs(fresh_logits(draft_model, committed), T1),
                               atol=1e-5, rtol=1e-4)


# --- greedy equality and seeded sampling: fixture chains and the demo pair ------------------


def _markov(seed: int, sharpness: float = 2.0) -> MarkovLM:
    return MarkovLM.random(VOCAB_SIZE, make_generator(seed), order=1, sharpness=sharpness)


FLOOR = 0.6  # the fixture draft's top token is below it in about half of its contexts


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_equals_plain_decoding_with_ragged_stops(k):
    proposer = _recording(DraftModelProposer(_markov(5), draft_p_min=FLOOR))
    decoder = Engine(_markov(3), proposer)
    prompts = [[3, 5, 2], [1], [7, 7, 2, 0]]
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=k, sampling=GREEDY)
    speculative = decoder.generate(prompts, config)
    assert speculative.token_ids == decoder.generate(prompts, config, speculative=False).token_ids
    assert _stopped_early(proposer)
    for prompt, expected in zip(prompts, speculative.token_ids):  # batch 1 too
        assert decoder.generate([prompt], config).token_ids == [expected]


@pytest.mark.parametrize("k", [2, 4])
def test_seeded_sampling_gives_the_text_of_plain_decoding_with_ragged_stops(k):
    proposer = _recording(DraftModelProposer(_markov(5, 1.0), draft_p_min=0.45))
    decoder = Engine(_markov(3, 1.0), proposer)
    prompts = [[3, 5, 2], [1], [7, 7, 2, 0]]
    config = GenerationConfig(max_new_tokens=30, num_draft_tokens=k, seed=11,
                              sampling=SamplingConfig(temperature=0.7))
    speculative = decoder.generate(prompts, config)
    assert speculative.token_ids == decoder.generate(prompts, config, speculative=False).token_ids
    assert _stopped_early(proposer)


@pytest.fixture(scope="module")
def demo_decoder():
    decoder = verispec.load(draft_p_min=0.5)
    _recording(decoder.engine.proposer)
    return decoder


@pytest.mark.parametrize("k", [1, 3, 6])
def test_demo_pair_greedy_and_seeded_equal_plain_decoding(demo_decoder, k):
    prompts = [prompt for prompt in heldout_prompts() if len(prompt) <= 160][:3]
    demo_decoder.engine.proposer.rounds.clear()
    for settings in ({"temperature": 0.0}, {"temperature": 0.7, "seed": 5}):
        outs = demo_decoder.generate(prompts, max_new_tokens=32, num_draft_tokens=k,
                                     **settings)
        plain = demo_decoder.generate(prompts, max_new_tokens=32, speculative=False,
                                      **settings)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], settings
    assert _stopped_early(demo_decoder.engine.proposer)


# --- the output law at temperature > 0 --------------------------------------------------------

PROMPT = [3, 5]


def _pair() -> tuple[MarkovLM, MarkovLM]:
    """An order-1 target and a draft near it, flat enough that the draft's top token is below
    LAW_FLOOR in some contexts and above it in others."""
    target = _markov(61, 1.2)
    noise = torch.randn(target.table.shape, generator=make_generator(62))
    return target, MarkovLM(target.table + 0.8 * noise)


LAW_FLOOR = 0.4


@pytest.mark.slow
@pytest.mark.parametrize("k, temperature, verification, seed", [
    (2, 1.0, "block", 51_001), (4, 1.0, "token", 51_002), (4, 1.0, "block", 51_003),
    (3, 0.7, "token", 51_004)])
def test_sampled_output_has_the_target_law(k, temperature, verification, seed):
    target, draft = _pair()
    proposer = _recording(DraftModelProposer(draft, draft_p_min=LAW_FLOOR))
    results, metrics = _proposer_law(target, proposer, k, temperature, seed, PROMPT,
                                     verification)
    assert _stopped_early(proposer) and 0 < metrics.num_accepted < metrics.num_drafted
    _assert_target_law(f"draft-p-min k={k} T={temperature} {verification}", results)


class _StopOnOwnToken:
    """Negative control: a floor-free draft model whose row ends before the first token that
    its own distribution gave less than ``floor`` (the token is drawn, then dropped). A
    proposed token is then a draw from the distribution cut to its likely tokens, verified as
    a draw from the whole one."""

    def __init__(self, draft: MarkovLM, floor: float) -> None:
        self.inner, self.floor = DraftModelProposer(draft), floor
        self.vocab_size, self.device, self.max_positions = draft.vocab_size, draft.device, None

    def start(self, prompts):
        session = self.inner.start(prompts)
        propose = session.propose

        def cut(plan, constraint=None):
            proposal = propose(plan, constraint)
            own = proposal.draft_probs.gather(-1, proposal.draft_tokens[..., None])[..., 0]
            unsure = (own < self.floor).tolist()  # [B][K]
            return Proposal(proposal.draft_tokens, proposal.draft_probs,
                            [next((j for j, u in enumerate(row) if u), len(row))
                             for row in unsure])

        session.propose = cut
        return session


@pytest.mark.slow
def test_a_stop_on_the_drawn_tokens_own_probability_is_rejected():
    target, draft = _pair()
    results, metrics = _proposer_law(target, _StopOnOwnToken(draft, LAW_FLOOR), 2, 1.0,
                                     51_100, PROMPT, "token")
    assert metrics.num_drafted > 0
    _assert_control_rejected("stop on the drawn token's probability", results)


# --- bad values --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, "0.5", True, None])
def test_bad_floors_raise_a_config_error_naming_the_setting(value):
    with pytest.raises(ConfigError, match=r"^draft_p_min=.* is invalid: expected a number"):
        DraftModelProposer(_markov(5), draft_p_min=value)
    with pytest.raises(ConfigError, match=r"^draft_p_min="):
        verispec.load(draft_p_min=value)  # checked before anything loads
    with pytest.raises(ConfigError, match=r"^draft_p_min="):
        ServerSettings(draft_p_min=value)


def test_a_floor_without_a_draft_model_is_refused():
    with pytest.raises(ConfigError, match="no draft model was given"):
        verispec.load(draft=verispec.NgramDraft(), draft_p_min=0.5)
    with pytest.raises(ConfigError, match="drop --draft-p-min"):
        ServerSettings(suffix=True, target="t", draft_p_min=0.5)


@pytest.mark.parametrize("extra, fragment", [
    (["--draft-p-min", "1.5"], "draft_p_min=1.5 is invalid"),
    (["--draft-p-min", "-1"], "draft_p_min=-1.0 is invalid"),
    (["--draft-p-min", "x"], "--draft-p-min: invalid float value"),
    (["--draft-p-min", "0.5", "--no-draft"], "drop --draft-p-min"),
])
def test_cli_bad_floors_exit_2_with_one_line(capsys, extra, fragment):
    try:
        status = cli.main(["generate", "x", *extra])
    except SystemExit as exc:  # argparse's own refusals (not a number)
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err
