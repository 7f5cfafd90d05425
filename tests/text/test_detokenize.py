"""Incremental detokenisation: the step texts concatenate to the whole decode, for byte-level
BPE (the demo pair's and the tiny models' kind) and for a SentencePiece-style tokenizer (word
starts marked by a space that a decode drops at its start), with random step sizes; no text
comes out while a character is incomplete. The negative control, decoding each step's tokens
alone, must fail the same check on the SentencePiece-style tokenizer. Stop strings (RowText): one
inside another cut the same text and token ids whatever the chunking."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from verispec.engine.metrics import MetricsRecorder
from verispec.text.demo import demo_pair
from verispec.text.detokenize import REPLACEMENT, IncrementalDetokenizer
from verispec.text.stream import RowText

from tiny_models import CORPUS, build_tokenizer

TEXT = "def add(a, b):\n    return a + b  # ü ✓ λ, naïve café 日本\n"


def sentencepiece_style_tokenizer() -> PreTrainedTokenizerFast:
    """BPE over '▁'-marked words with byte fallback: Llama-2's and Mistral's scheme."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Sequence([
        decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="always")])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>", *byte_tokens])
    tokenizer.train_from_iterator([TEXT, *CORPUS] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>")


def demo_tokenizer():
    return AutoTokenizer.from_pretrained(demo_pair().target)


TOKENIZERS = {"byte-level (tiny)": build_tokenizer, "byte-level (demo pair)": demo_tokenizer,
              "sentencepiece-style": sentencepiece_style_tokenizer}


def random_steps(token_ids: list[int], generator: torch.Generator) -> list[list[int]]:
    """token_ids cut into consecutive steps of 1-5 tokens (a speculative round's sizes)."""
    steps, start = [], 0
    while start < len(token_ids):
        size = int(torch.randint(1, 6, (), generator=generator))
        steps.append(token_ids[start : start + size])
        start += size
    return steps


def token_streams(tokenizer, generator: torch.Generator) -> list[list[int]]:
    """Real text's tokens (cut anywhere: mid-word, mid-character) and random token ids (any
    byte sequence, invalid UTF-8 and special tokens included)."""
    text_ids = tokenizer.encode(TEXT + " ".join(CORPUS[:4]))
    streams = [text_ids[start:] for start in range(12)]
    vocab = len(tokenizer)
    streams += [torch.randint(0, vocab, (40,), generator=generator).tolist() for _ in range(30)]
    return streams


def incremental(tokenizer, steps: list[list[int]]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add(step) for step in steps]
    return pieces + [detokenizer.add([], final=True)]


def step_alone(tokenizer, steps: list[list[int]]) -> list[str]:
    """The negative control: each step's tokens decoded without their left neighbour."""
    return [tokenizer.decode(step, skip_special_tokens=True) for step in steps]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_step_texts_concatenate_to_the_whole_decode(name):
    tokenizer = TOKENIZERS[name]()
    generator = torch.Generator().manual_seed(0)
    for token_ids in token_streams(tokenizer, generator):
        steps = random_steps(token_ids, generator)
        pieces = incremental(tokenizer, steps)
        assert "".join(pieces) == tokenizer.decode(token_ids, skip_special_tokens=True), steps
        if not _has_invalid_bytes(tokenizer, token_ids):
            # no step text ends inside a character (the final flush may: the output was cut)
            assert not any(piece.endswith(REPLACEMENT) for piece in pieces[:-1]), pieces


def _has_invalid_bytes(tokenizer, token_ids: list[int]) -> bool:
    """Whether the tokens' bytes hold invalid UTF-8 of their own (random ids do), which decodes
    to U+FFFD wherever it stands, not only at the end."""
    return REPLACEMENT in tokenizer.decode(token_ids[:-1], skip_special_tokens=True)


def test_decoding_each_step_alone_fails_the_same_check():
    """The check above can fail: without the left neighbour, word-start spaces are dropped
    (SentencePiece style) and characters split across steps come out as U+FFFD."""
    for name in ("sentencepiece-style", "byte-level (tiny)"):
        tokenizer = TOKENIZERS[name]()
        token_ids = tokenizer.encode(TEXT)
        steps = [token_ids[i : i + 1] for i in range(len(token_ids))]
        whole = tokenizer.decode(token_ids, skip_special_tokens=True)
        assert "".join(step_alone(tokenizer, steps)) != whole, name
        assert "".join(incremental(tokenizer, steps)) == whole, name


def test_worked_example_waits_for_the_last_byte_of_a_character():
    tokenizer = build_tokenizer()
    a = tokenizer.convert_tokens_to_ids("a")
    u_umlaut = [tokenizer.convert_tokens_to_ids(t) for t in ("Ã", "¼")]  # the bytes C3 BC
    assert tokenizer.decode(u_umlaut) == "ü"
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add([a]) == "a"
    assert detokenizer.add(u_umlaut[:1]) == ""  # ends inside "ü"
    assert detokenizer.add(u_umlaut[1:]) == "ü"
    assert detokenizer.add(u_umlaut[:1]) == ""
    assert detokenizer.add([], final=True) == REPLACEMENT  # cut inside a character: U+FFFD
    assert detokenizer.token_ids == [a, *u_umlaut, u_umlaut[0]]


def test_special_tokens_add_no_text():
    tokenizer = build_tokenizer()
    eos = tokenizer.eos_token_id
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add(tokenizer.encode("ab")) == "ab"
    assert detokenizer.add([eos]) == ""
    assert detokenizer.add(tokenizer.encode("c")) == "c"
    assert detokenizer.add([], final=True) == ""


# ---------------------------------------------------------------------------------------------
# stop strings (text.stream.RowText): the cut is a function of the text, not of the chunking

NESTED_STOPS = ("\n\nUser:", "User")  # "User" lies inside "\n\nUser:" and completes first


def row_text(tokenizer, chunks: list[list[int]], stop: tuple[str, ...]):
    """The chunks fed to a RowText as rounds deliver them -> (its Completion, the deltas)."""
    text = RowText(tokenizer, stop, num_prompt_tokens=1)
    deltas = []
    for chunk in chunks:
        delta, done = text.feed(chunk, final=False)
        deltas.append(delta)
        if done:
            break
    else:
        deltas.append(text.feed([], final=True)[0])
    return text.completion("length", MetricsRecorder().snapshot()), deltas


def test_nested_stop_strings_cut_where_token_by_token_feeding_cuts():
    """Plain decoding delivers one token a round, speculative decoding several: the cut must be
    the stop string that completes first (the earliest end), whatever the chunking."""
    tokenizer = demo_tokenizer()
    token_ids = tokenizer.encode("hello\n\nUser: hi")
    one_by_one, deltas = row_text(tokenizer, [[t] for t in token_ids], NESTED_STOPS)
    assert one_by_one.text == "hello\n\n" == "".join(deltas)
    assert one_by_one.finish_reason == "stop"
    generator = torch.Generator().manual_seed(0)
    for chunks in [[token_ids], *(random_steps(token_ids, generator) for _ in range(20))]:
        completion, deltas = row_text(tokenizer, chunks, NESTED_STOPS)
        assert (completion.text, completion.token_ids, completion.finish_reason) == (
            one_by_one.text, one_by_one.token_ids, "stop"), chunks
        assert "".join(deltas) == completion.text
    assert tokenizer.decode(one_by_one.token_ids).startswith("hello\n\n")
