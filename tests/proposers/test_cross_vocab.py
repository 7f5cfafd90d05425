"""The cross-vocabulary proposer (proposers/cross_vocab/): a draft of another tokenizer.

Three layers. Exactness through the engine: the law of the first emitted tokens at T = 1 is
the target's for both rules under both verification rules (G-test), and the same test
rejects the controls that accept out-of-intersection tokens unconditionally
(cross_controls.py); greedy and seeded rows equal plain decoding token for token on tiny
random-init transformers with different byte-level BPE tokenizers and on script models
(script_lm.py, where drafts are often right), in batches rows join and leave. Boundaries:
a character split across target tokens, a draft token ending inside a target token, special
tokens. Bookkeeping: the draft's cache stays its own encoding of the committed text.

Legend: N samples (rows), V vocabulary, k draft tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec import BatchOptions, Engine, GenerationConfig, MarkovLM, SamplingConfig
from verispec.errors import ConfigError, IncompatibleModelsError
from verispec.proposers.base import DraftPlan
from verispec.proposers.cross_vocab import CROSS_VOCAB_RULES, CrossVocabProposer
from verispec.proposers.cross_vocab.context import DraftContext
from verispec.proposers.cross_vocab.vocab import shared_pairs
from verispec.proposers.draft_model import DraftModelProposer
from verispec.sample.sampling import make_generator
from verispec.text.assemble import wrap_model

from cross_controls import leaky_proposer
from law_checks import VOCAB_SIZE, _assert_control_rejected, _assert_target_law, _check_law
from script_lm import ScriptLM
from tiny_models import CORPUS, build_tokenizer, layer_dropped_draft, untied_llama
from token_texts import ByteLevelText, PieceText

pytestmark = pytest.mark.usefixtures("single_thread_torch")

GREEDY = SamplingConfig(temperature=0.0)
HOT = SamplingConfig(temperature=1.0)

# Two vocabularies over the same bytes: the target's merges (ab, ca, abc) are not the draft's
# (bc, " a", cab); a, b, c, " " and the special </s> are shared, so the intersection rule gives
# ab, ca and abc q = 0 while the target gives them mass.
TARGET_TEXT = PieceText([b"a", b"b", b"c", b"ab", b"ca", b"abc", b" ", b"</s>"], [7])
DRAFT_TEXT = PieceText([b"a", b"b", b"c", b" ", b"bc", b" a", b"cab", b"</s>"], [7])
assert TARGET_TEXT.vocab_size == VOCAB_SIZE  # the law harness counts pairs of VOCAB_SIZE ids
PROMPT = [0, 6]  # "a "
NUM_SAMPLES = 10_000


def _markov_pair() -> tuple[MarkovLM, MarkovLM]:
    return (MarkovLM.random(8, make_generator(1), sharpness=1.0),
            MarkovLM.random(8, make_generator(2), sharpness=1.0))


def _cross(target_text=TARGET_TEXT, draft_text=DRAFT_TEXT, rule="string", draft=None):
    draft = _markov_pair()[1] if draft is None else draft
    return CrossVocabProposer(draft, draft_text, target_text, rule)


def _law(proposer, k: int, verification: str, seed: int):
    """G-tests of N rows of k + 1 tokens after PROMPT at T = 1 -> (results, metrics)."""
    target = _markov_pair()[0]
    config = GenerationConfig(max_new_tokens=k + 1, num_draft_tokens=k, sampling=HOT,
                              verification=verification)
    result = Engine(target, proposer).generate([PROMPT] * NUM_SAMPLES, config,
                                               generator=make_generator(seed))
    tokens = np.array(result.token_ids, dtype=np.int64)
    return _check_law(target, tokens, HOT, prompt=PROMPT), result.metrics


# --- the law of emitted tokens ----------------------------------------------------------------


# the string rule's proposal is deterministic: block verification takes it token-wise too
@pytest.mark.parametrize("rule, verification, k", [
    ("string", "token", 2), ("intersection", "block", 2), ("intersection", "token", 3)])
def test_the_sampled_law_is_the_targets(rule, verification, k):
    results, metrics = _law(_cross(rule=rule), k, verification, seed=11)
    assert 0.05 < metrics.acceptance_rate < 0.95  # kept and rejected drafts both occur
    _assert_target_law(f"cross {rule} {verification} k={k}", results)


@pytest.mark.parametrize("rule", CROSS_VOCAB_RULES)
def test_the_law_test_rejects_accepting_out_of_intersection_tokens(rule):
    target, draft = _markov_pair()
    results, _ = _law(leaky_proposer(draft, DRAFT_TEXT, TARGET_TEXT, rule), 2, "token", seed=12)
    _assert_control_rejected(f"cross {rule} leaky", results)


def test_intersection_drafts_only_shared_tokens_with_the_probs_drawn_from():
    proposer = _cross(rule="intersection")
    session = proposer.start([PROMPT] * 64)
    proposal = session.propose(DraftPlan.uniform(64, 3, HOT, make_generator(3)))
    probs = proposal.draft_probs  # [N, K, V]
    outside = TARGET_TEXT.ids(b"ab", b"ca", b"abc")
    assert probs[..., outside].max() == 0.0  # q = 0 off the intersection
    drawn = probs.gather(-1, proposal.draft_tokens[..., None])[..., 0]
    assert drawn.min() > 0 and torch.allclose(probs.sum(-1), torch.ones(64, 3))
    assert not set(proposal.draft_tokens.reshape(-1).tolist()) & set(outside)


def test_a_registered_draft_prompt_is_the_drafts_context_and_keeps_the_text():
    """A chat rendered with the draft's own template (DraftPrompts): the draft's context
    starts with those ids instead of its tokens of the target prompt's text; an unregistered
    prompt keeps the text; greedy rows still equal plain decoding."""
    target, draft = _script_pair()
    proposer = CrossVocabProposer(draft, draft.text, target.text, "string")
    registered, other = target.text.encode("def"), target.text.encode("a + b")
    own = draft.text.encode("<s>def")
    proposer.draft_prompts.register(registered, own)
    session = proposer.start([registered, other])
    assert session.rows[0].context.ids == own
    assert session.rows[1].context.ids == draft.text.encode("a + b")
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=3, sampling=GREEDY)
    engine = Engine(target, proposer)
    spec = engine.generate([registered, other], config)
    assert spec.token_ids == engine.generate([registered, other], config,
                                             speculative=False).token_ids
    assert spec.metrics.num_accepted > 0


def test_draft_prompts_keep_the_most_recent():
    from verispec.proposers.cross_vocab import DraftPrompts

    prompts = DraftPrompts(capacity=2)
    for n in range(3):
        prompts.register([n], [10 + n])
    prompts.register([1], [21])  # re-registered: the most recent again
    prompts.register([3], [13])
    assert prompts.get([0]) is None and prompts.get([2]) is None
    assert prompts.get([1]) == [21] and prompts.get([3]) == [13]


# --- greedy and seeded rows equal plain decoding ----------------------------------------------

SCRIPT = "def add(a, b):\n    return a + b  # ✓ sum\n"
DRAFT_SCRIPT = "def add(a, b):\n    return a - b  # ✓ sum\n"  # the draft is wrong at "-"


def _script_pair(sharpness: float = 6.0):
    """Target and draft script models over vocabularies that split the script differently:
    the target's has "\\xe2\\x9c" (the check mark's first two bytes) and byte tokens, the
    draft's the whole check mark; specials of the same text at other ids."""
    single = [bytes([c]) for c in sorted(set(SCRIPT.encode() + DRAFT_SCRIPT.encode()))]
    target_text = PieceText(single + [b"de", b"def", b"    ", b" return", b" a", b"\xe2\x9c",
                                      b"</s>"], [len(single) + 6])
    draft_text = PieceText([b"<s>", b"</s>"] + single[::-1] + [
        b"ad", b"(a", b"return", b" +", b" ", b"\xe2\x9c\x93", b"    "], [0, 1])
    return (ScriptLM(target_text, SCRIPT, sharpness), ScriptLM(draft_text, DRAFT_SCRIPT,
                                                                sharpness, seed=1))


@pytest.mark.parametrize("rule", CROSS_VOCAB_RULES)
@pytest.mark.parametrize("k", [1, 3])
def test_script_pair_greedy_and_seeded_rows_equal_plain_decoding(rule, k):
    target, draft = _script_pair()
    engine = Engine(target, CrossVocabProposer(draft, draft.text, target.text, rule))
    prompts = [target.text.encode("def"), target.text.encode("a + b"),
               target.text.encode("# \u2713")]
    for sampling, seed in ((GREEDY, None), (SamplingConfig(temperature=0.8, top_p=0.9), 5)):
        config = GenerationConfig(max_new_tokens=48, num_draft_tokens=k, sampling=sampling,
                                  seed=seed)
        spec = engine.generate(prompts, config)
        assert spec.token_ids == engine.generate(prompts, config, speculative=False).token_ids
        assert spec.metrics.acceptance_rate > 0.3, (rule, k, sampling)


@pytest.fixture(scope="module")
def tiny_pair():
    """A tiny Llama target over a byte-level BPE (CORPUS, 320 ids, <|im_start|> special) and a
    draft over another (other merges, 300 ids, specials at other ids), both random-init;
    the target's layer-dropped copy as a same-vocabulary draft."""
    target_tokenizer = build_tokenizer(320, special_tokens=("<|endoftext|>", "<|im_start|>"))
    draft_tokenizer = build_tokenizer(300, corpus=[line[::-1] for line in CORPUS],
                                      special_tokens=("<|im_start|>", "<|im_end|>",
                                                      "<|endoftext|>"))
    target = untied_llama(len(target_tokenizer), seed=1, max_positions=128)
    draft = untied_llama(len(draft_tokenizer), seed=2, max_positions=128)
    pair = dict(same=wrap_model(layer_dropped_draft(target), len(target_tokenizer), "fast"),
                target_text=ByteLevelText(target_tokenizer),
                draft_text=ByteLevelText(draft_tokenizer))
    for backend in ("fast", "transformers"):
        pair[backend, "target"] = wrap_model(target, len(target_tokenizer), backend)
        pair[backend, "draft"] = wrap_model(draft, len(draft_tokenizer), backend)
    return pair


def _tiny_engine(pair, rule: str, backend: str = "fast") -> Engine:
    return Engine(pair[backend, "target"], CrossVocabProposer(
        pair[backend, "draft"], pair["draft_text"], pair["target_text"], rule))


TINY_PROMPTS = ["def add(a, b):", "<|im_start|>héllo wörld ✓", "for i in"]


@pytest.mark.parametrize("backend", ["fast", "transformers"])
@pytest.mark.parametrize("rule", CROSS_VOCAB_RULES)
@pytest.mark.parametrize("k", [1, 3])
def test_tiny_models_greedy_equals_plain_greedy(tiny_pair, rule, k, backend):
    engine = _tiny_engine(tiny_pair, rule, backend)
    prompts = [tiny_pair["target_text"].encode(text) for text in TINY_PROMPTS]
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=k, sampling=GREEDY)
    spec = engine.generate(prompts, config)
    assert spec.token_ids == engine.generate(prompts, config, speculative=False).token_ids
    assert spec.metrics.num_drafted > 0


def _run_alone(engine, prompt, config):
    batch = engine.batch()
    (row,) = batch.add([prompt], [config], [make_generator(0)])
    while batch.rows:
        batch.step()
    return row.token_ids


@pytest.mark.parametrize("rule", CROSS_VOCAB_RULES)
def test_rows_joining_and_leaving_keep_each_rows_greedy_text(tiny_pair, rule):
    engine = _tiny_engine(tiny_pair, rule)
    prompts = [tiny_pair["target_text"].encode(text) for text in TINY_PROMPTS]
    config = GenerationConfig(max_new_tokens=20, sampling=GREEDY)
    alone = [_run_alone(engine, prompt, config) for prompt in prompts]
    batch = engine.batch(options=BatchOptions(num_draft_tokens=3))
    first, second = batch.add(prompts[:2], [config] * 2, [make_generator(0)] * 2)
    for _ in range(2):
        batch.step()
    (third,) = batch.add(prompts[2:], [config], [make_generator(0)])
    batch.step()
    batch.remove([first])
    while batch.rows:
        batch.step()
    assert first.token_ids == alone[0][: len(first.token_ids)]
    assert (second.token_ids, third.token_ids) == (alone[1], alone[2])


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.7),
                                      SamplingConfig(temperature=1.0, top_p=0.9)])
def test_seeded_rows_equal_plain_and_same_vocabulary_decoding(tiny_pair, sampling):
    prompts = [tiny_pair["target_text"].encode(text) for text in TINY_PROMPTS]
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3, sampling=sampling,
                              seed=2024)
    plain = Engine(tiny_pair["fast", "target"]).generate(prompts, config).token_ids
    same = Engine(tiny_pair["fast", "target"], DraftModelProposer(tiny_pair["same"])).generate(
        prompts, config).token_ids
    assert same == plain and len({tuple(row) for row in plain}) == 3
    for rule in CROSS_VOCAB_RULES:
        assert _tiny_engine(tiny_pair, rule).generate(prompts, config).token_ids == plain, rule


# --- boundaries -------------------------------------------------------------------------------

CHECK = "\u2713".encode()  # b"\xe2\x9c\x93"
BYTES_TEXT = PieceText([b"a", b" ", CHECK[:1], CHECK[1:2], CHECK[2:], CHECK[:2], b"ab",
                        b"<|im_end|>"], [7])
REPLACEMENT = "\ufffd".encode()  # what bytes that are not UTF-8 become
WHOLE_TEXT = PieceText([b"<|im_end|>", b"a", b" ", b"b", CHECK, b"a" + CHECK, REPLACEMENT], [0])


def test_a_character_split_across_target_tokens_reaches_the_draft_whole():
    context = DraftContext(WHOLE_TEXT)
    assert context.append(b"a " + CHECK[:1]) == 0
    assert (context.ids, context.pending) == (WHOLE_TEXT.ids(b"a", b" "), CHECK[:1])
    assert context.append(CHECK[1:2]) == 2  # still unfinished: nothing changed
    context.append(CHECK[2:] + b"a")
    assert (context.ids, context.pending) == (WHOLE_TEXT.ids(b"a", b" ", CHECK, b"a"), b"")
    context.append(b"\xffb")  # not UTF-8: the draft reads U+FFFD
    assert context.ids[-2:] == WHOLE_TEXT.ids(REPLACEMENT, b"b") and context.pending == b""


def test_string_rule_continues_a_character_the_target_left_unfinished():
    rule = _cross(BYTES_TEXT, WHOLE_TEXT).rule
    drawn = WHOLE_TEXT.ids(CHECK, b"a", b" ")
    # the committed text ends with the check mark's first two bytes (one target token): the
    # proposal is the target's tokens of the rest, the last dropped (" " may grow)
    assert rule.continuation(CHECK[:2], drawn) == (BYTES_TEXT.ids(CHECK[2:], b"a"), False)
    # with its first byte alone committed, the target's encoding has no token ending there
    assert rule.continuation(CHECK[:1], drawn) == ([], True)
    # a draft that does not begin with the committed bytes proposes nothing
    assert rule.continuation(b"\xe3", drawn) == ([], True)


def test_intersection_rows_whose_text_ends_inside_a_character_wait_for_it():
    session = _cross(BYTES_TEXT, WHOLE_TEXT, "intersection",
                     MarkovLM.random(7, make_generator(0))).start([
        BYTES_TEXT.ids(b"a", b" ", CHECK[:1]), BYTES_TEXT.ids(b"a", b" ", b"a")])
    proposal = session.propose(DraftPlan.uniform(2, 2, HOT, make_generator(0)))
    assert proposal.num_proposed == [0, 2]
    session.commit([0, 0], BYTES_TEXT.ids(CHECK[1:2], b"a"))
    session.commit([0, 0], BYTES_TEXT.ids(CHECK[2:], b"a"))  # the character is whole
    assert session.propose(DraftPlan.uniform(2, 2, HOT, make_generator(0))).num_proposed == [
        2, 2]


def test_string_rule_drops_the_target_token_a_draft_token_ends_inside():
    rule = _cross(BYTES_TEXT, WHOLE_TEXT).rule
    # draft "a" then "b": "ab" is one target token, which "a" alone would have split
    assert rule.continuation(b"", WHOLE_TEXT.ids(b"a")) == ([], False)
    assert rule.continuation(b"", WHOLE_TEXT.ids(b"a", b" ")) == (BYTES_TEXT.ids(b"a"), False)
    # the draft's end of text (a special) makes its last token final, and maps by text
    assert rule.continuation(b"", WHOLE_TEXT.ids(b"a", b" ", b"<|im_end|>")) == (
        BYTES_TEXT.ids(b"a", b" ", b"<|im_end|>"), True)


def test_special_tokens_are_shared_by_text_and_reach_the_draft_as_its_own():
    pairs = shared_pairs(WHOLE_TEXT, BYTES_TEXT, 7, 8)
    assert (0, 7) in pairs and (1, 0) in pairs  # <|im_end|>, a
    context = DraftContext(WHOLE_TEXT)
    context.append(b"a<|im_end|>")  # the target's special token's text
    assert context.ids == WHOLE_TEXT.ids(b"a", b"<|im_end|>")


def test_incremental_context_equals_encoding_the_whole_text():
    text = DRAFT_TEXT
    data = b"a cab abc bca  a b cabc ab a" * 3
    context = DraftContext(text, prefix=[7])
    cuts = sorted(set(np.random.default_rng(0).integers(1, len(data), 30).tolist()))
    for start, end in zip([0] + cuts, cuts + [len(data)]):
        context.append(data[start:end])
    assert context.ids[0] == 7
    assert b"".join(text.piece(i) for i in context.ids[1:]) == data


def test_a_tokenizer_whose_pieces_do_not_spell_the_text_keeps_windows_short():
    class Normalising(PieceText):
        """Writes "z" as "a", as a tokenizer that normalises text would."""

        def __init__(self) -> None:
            super().__init__([b"a", b"b", b" ", b"ab"])
            self.lengths: list[int] = []

        def encode(self, text: str) -> list[int]:
            self.lengths.append(len(text))
            return super().encode(text.replace("z", "a"))

    text = Normalising()
    context = DraftContext(text)
    data = b"z" + b"ab ab b a " * 20
    for at in range(len(data)):
        context.append(data[at: at + 1])
    assert b"".join(text.piece(i) for i in context.ids) == data.replace(b"z", b"a")
    assert max(text.lengths) <= 8  # the "z" no window can start after is not re-encoded


# --- bookkeeping ------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", CROSS_VOCAB_RULES)
def test_the_draft_cache_holds_its_own_tokens_of_the_committed_text(rule):
    target, draft = _script_pair()
    proposer = CrossVocabProposer(draft, draft.text, target.text, rule)
    committed = [target.text.encode("def a"), target.text.encode("    re")]
    session = proposer.start(committed)
    generator = make_generator(0)
    for round_index in range(6):
        if round_index == 2:
            session.add_rows([target.text.encode("b):")], defer=True)
            committed.append(target.text.encode("b):"))
        if round_index == 4:
            session.keep_rows([2, 0])
            committed = [committed[2], committed[0]]
        if round_index == 3:
            session.catch_up()
        plan = DraftPlan.uniform(len(committed), 3, HOT, generator)
        drafted = session.propose(plan).draft_tokens.tolist()
        accepted = [(round_index + row) % 3 for row in range(len(committed))]
        next_tokens = target.text.encode("e" * len(committed))
        session.commit(accepted, next_tokens)
        committed = [row + d[:n] + [t] for row, d, n, t in
                     zip(committed, drafted, accepted, next_tokens)]
        for row, state, cache in zip(committed, session.rows, session.session.rows):
            text = b"".join(target.text.piece(t) for t in row)
            assert b"".join(draft.text.piece(i) for i in state.context.ids) == text
            assert cache == state.fed == state.context.ids[: len(cache)]
            assert len(cache) < len(state.context.ids)


def test_rows_whose_context_outgrows_the_drafts_window_stop_drafting():
    target, draft = _script_pair()
    draft.max_positions = 24  # the script session asserts every row fits it
    engine = Engine(target, CrossVocabProposer(draft, draft.text, target.text, "string"))
    config = GenerationConfig(max_new_tokens=40, sampling=GREEDY)
    prompts = [target.text.encode("def"), target.text.encode("return a + b  # ")]
    batch = engine.batch(options=BatchOptions(num_draft_tokens=3))
    rows = batch.add(prompts, [config] * 2, [make_generator(0)] * 2)
    parked = []
    while batch.rows:
        batch.step()
        parked.append([row.context is None for row in batch.proposer.rows])
    assert parked[0] == [False, False] and [True, True] in parked
    assert [row.token_ids for row in rows] == engine.generate(
        prompts, config, speculative=False).token_ids
    assert rows[0].metrics.num_drafted > 0


@pytest.mark.parametrize("rule", CROSS_VOCAB_RULES)
def test_a_row_with_non_finite_draft_logits_fails_alone(rule):
    draft = _markov_pair()[1]
    table = draft.table.clone()
    table[DRAFT_TEXT.ids(b"cab")[0]] = float("nan")  # after "cab" the draft is broken
    proposer = _cross(rule=rule, draft=MarkovLM(table))
    session = proposer.start([TARGET_TEXT.encode("a cab"), TARGET_TEXT.encode("a b")])
    proposal = session.propose(DraftPlan.uniform(2, 2, HOT, make_generator(0)))
    assert set(proposal.faults) == {0} and proposal.num_proposed[1] == 2


def test_intersection_rows_that_may_draw_no_shared_token_end_their_draft():
    """A bias of -inf on every shared token (the grammar or a ban may do as much): the row
    proposes nothing, and does not fail."""

    class BanShared:
        def process_draft(self, logits, drafted):
            return torch.full_like(logits, float("-inf")).index_fill(0, torch.tensor([3]), 0.0)

    session = _cross(rule="intersection").start([PROMPT, PROMPT])
    plan = DraftPlan([2, 2], [HOT, HOT], [make_generator(0)] * 2, None, [BanShared(), None])
    proposal = session.propose(plan)
    assert proposal.num_proposed == [0, 2] and not proposal.faults


# --- bad input --------------------------------------------------------------------------------


def test_an_unknown_rule_is_a_config_error_naming_the_rules():
    with pytest.raises(ConfigError, match="rule='token'.*'string' or 'intersection'") as info:
        _cross(rule="token")
    assert info.value.field == "rule"


def test_an_empty_intersection_is_an_incompatible_pair():
    disjoint = PieceText([b"x", b"y", b"z", b"xy"])
    with pytest.raises(IncompatibleModelsError, match="share none.*rule='string'") as info:
        CrossVocabProposer(MarkovLM.random(4, make_generator(0)), disjoint, TARGET_TEXT,
                           "intersection")
    assert info.value.field == "rule"
    CrossVocabProposer(MarkovLM.random(4, make_generator(0)), disjoint, TARGET_TEXT, "string")


def test_a_tokenizer_wider_than_its_model_is_refused():
    with pytest.raises(IncompatibleModelsError, match="draft_text has 8 ids") as info:
        CrossVocabProposer(MarkovLM.random(4, make_generator(0)), DRAFT_TEXT, TARGET_TEXT,
                           "string")
    assert info.value.field == "draft"
