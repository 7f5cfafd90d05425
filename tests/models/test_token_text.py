"""Tokenizers seen as bytes (models/token_text.py) and the vocabulary two of them share.

The round trip b"".join(piece(i) for i in encode(s)) == s.encode() on every kind of tokenizer
verispec loads: the tiny byte-level BPE of the suite, SentencePiece-style tokenizers built here
(Metaspace pre-tokenizer, and the older normalizer that prepends "\u2581", both with byte
fallback), the demo pair's tokenizer, and llama.cpp's tokenizers of the packaged GGUFs (loaded
once, vocabulary only). A TokenText that drops SentencePiece's spaces must fail the same check
(the negative control). Pieces agree with each tokenizer's own decoder; a continuation gets no
leading space and no BOS; special tokens are flagged and matched by text across tokenizers; the
shared vocabulary of the real pairs pairs only tokens with equal bytes, and all of them.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from verispec.errors import IncompatibleModelsError, TokenOutOfRangeError
from verispec.models.base import TokenText
from verispec.models.hf.token_text import BYTE_LEVEL, SENTENCEPIECE, bytes_to_unicode
from verispec.models.llama_cpp.model import LlamaCppModel, bindings
from verispec.models.llama_cpp.tokenizer import LlamaCppTokenizer
from verispec.models.packaged import packaged_model_path
from verispec.models.token_text import (
    VocabMap,
    check_cross_pair,
    check_decodes_text,
    shared_vocabulary,
    token_text,
)
from verispec.text.demo import demo_pair

from tiny_models import CORPUS, build_tokenizer

GGUFS = ("smollm2-135m-instruct", "gemma-3-270m", "qwen2.5-coder-1.5b-instruct")
TEXTS = (
    "def add(a, b):\n    return a + b\n",
    "  leading and trailing spaces  ",
    "\n\n\ttabs\tand\r\nnewlines\n",
    "naïve café, Grüße, 日本語のテキスト",
    "emoji 🙂👍🏽🇫🇷 and ✓ → λ, rare ꙮ𓀀🪼",
    "x",
    "",
)
# special-token text each tokenizer parses as one token (chat markers where it has them)
SPECIAL_TEXTS = {"tiny": ["<|endoftext|>"], "demo": ["<|endoftext|>"],
                 "sp-metaspace": ["<|im_end|>", "</s>"], "sp-normalizer": ["<|im_end|>", "</s>"],
                 "smollm2-135m-instruct": ["<|im_start|>", "<|im_end|>"],
                 "gemma-3-270m": ["<start_of_turn>", "<end_of_turn>"],
                 "qwen2.5-coder-1.5b-instruct": ["<|im_start|>", "<|im_end|>"]}
SP_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]


def sentencepiece_tokenizer(style: str) -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE with byte fallback, trained here: "metaspace" (a Metaspace
    pre-tokenizer that prepends "\u2581" to every section) or "normalizer" (the older form: a
    normalizer that prepends "\u2581" and turns spaces into it)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                           decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=220,
                                                                  special_tokens=SP_SPECIALS))
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):  # the byte-fallback tokens SentencePiece files carry
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    if style == "normalizer":
        tokenizer.pre_tokenizer = None
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                     normalizers.Replace(" ", "\u2581")])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=["<|im_end|>"])


@pytest.fixture(scope="module")
def hf_tokenizers():
    return {"tiny": build_tokenizer(), "demo": AutoTokenizer.from_pretrained(demo_pair().draft),
            "sp-metaspace": sentencepiece_tokenizer("metaspace"),
            "sp-normalizer": sentencepiece_tokenizer("normalizer")}


@pytest.fixture(scope="module")
def gguf_tokenizers():
    return {name: LlamaCppTokenizer(LlamaCppModel(packaged_model_path(name), "draft",
                                                  vocab_only=True)) for name in GGUFS}


@pytest.fixture(scope="module")
def texts(hf_tokenizers, gguf_tokenizers):
    return {name: token_text(tokenizer)
            for name, tokenizer in {**hf_tokenizers, **gguf_tokenizers}.items()}


def spelled(text: TokenText, ids: list[int]) -> bytes:
    return b"".join(text.piece(i) for i in ids)


def assert_round_trip(text: TokenText, samples) -> None:
    for sample in samples:
        ids = text.encode(sample)
        assert spelled(text, ids) == sample.encode(), (sample, ids)


def all_samples(name: str) -> list[str]:
    return [*TEXTS, *(f"a{marker}\nb {marker} c" for marker in SPECIAL_TEXTS[name])]


@pytest.mark.parametrize("name", list(SPECIAL_TEXTS))
def test_pieces_of_encode_spell_the_text(texts, name):
    assert isinstance(texts[name], TokenText)
    assert_round_trip(texts[name], all_samples(name))


@pytest.mark.parametrize("name", ["tiny", "demo", "smollm2-135m-instruct",
                                  "qwen2.5-coder-1.5b-instruct"])
def test_byte_level_pieces_split_characters(texts, name):
    # the round trip covers pieces that are part of a UTF-8 character, not only whole ones
    pieces = [texts[name].piece(i) for i in texts[name].encode("日本語 ꙮ𓀀🪼")]
    assert any(not _is_utf8(piece) for piece in pieces)


def test_the_kind_of_each_transformers_tokenizer(texts):
    assert texts["tiny"].kind == texts["demo"].kind == BYTE_LEVEL
    assert texts["sp-metaspace"].kind == texts["sp-normalizer"].kind == SENTENCEPIECE


def test_dropping_sentencepiece_spaces_fails_the_round_trip(hf_tokenizers, texts):
    # the negative control: the same check rejects a TokenText that maps "\u2581" to nothing
    broken = DroppedSpaces(texts["sp-metaspace"], hf_tokenizers["sp-metaspace"])
    assert_round_trip(broken, ["x"])  # the control spells what has no space
    with pytest.raises(AssertionError):
        assert_round_trip(broken, TEXTS)
    with pytest.raises(IncompatibleModelsError, match="cannot turn its tokens back into text"):
        check_decodes_text(broken, "draft")
    check_decodes_text(texts["sp-metaspace"], "draft")


@pytest.mark.parametrize("name", ["sp-metaspace", "sp-normalizer"])
def test_sentencepiece_continuation_has_no_space_mark(hf_tokenizers, texts, name):
    tokenizer, text = hf_tokenizers[name], texts[name]
    # the tokenizer itself marks a space before the first word: what encode must undo
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("world"))[0].startswith("\u2581")
    ids = text.encode("world")
    assert spelled(text, ids) == b"world" and tokenizer.bos_token_id not in ids
    assert spelled(text, text.encode("<|im_end|>world")) == b"<|im_end|>world"


@pytest.mark.parametrize("name", list(SPECIAL_TEXTS))
def test_continuation_gets_no_bos_and_no_leading_space(texts, name):
    text = texts[name]
    ids = text.encode("world")
    assert not any(text.is_special(i) for i in ids)
    assert spelled(text, ids[:1]).startswith(b"w")


def test_llama_cpp_space_prefix_is_not_added():
    # a SentencePiece GGUF that sets add_space_prefix (forced on here) puts a space before the
    # first word and after each special token; its TokenText must not
    tokenizer = LlamaCppTokenizer(LlamaCppModel(packaged_model_path("gemma-3-270m"), "draft",
                                                vocab_only=True, add_space_prefix=True))
    raw = tokenizer.encode("Hello<end_of_turn>world", add_special_tokens=False)
    assert tokenizer.decode(raw, skip_special_tokens=False) == " Hello<end_of_turn> world"
    text = token_text(tokenizer)
    assert_round_trip(text, all_samples("gemma-3-270m"))
    assert text.encode("Hello<end_of_turn>world") != raw


@pytest.mark.parametrize("name", ["tiny", "demo", "sp-metaspace", "sp-normalizer"])
def test_pieces_agree_with_transformers_decode(hf_tokenizers, texts, name):
    for sample in all_samples(name):
        ids = texts[name].encode(sample)
        assert spelled(texts[name], ids).decode() == hf_tokenizers[name].decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("name", GGUFS)
def test_pieces_agree_with_llama_cpp_detokenize(gguf_tokenizers, texts, name):
    for sample in all_samples(name):
        ids = texts[name].encode(sample)
        assert spelled(texts[name], ids) == detokenize(gguf_tokenizers[name], ids)


def test_special_tokens_are_flagged(texts, hf_tokenizers, gguf_tokenizers):
    for name in ("tiny", "demo", "sp-metaspace"):
        tokenizer = hf_tokenizers[name]
        for token_id in tokenizer.all_special_ids:
            assert texts[name].is_special(token_id)
            assert texts[name].piece(token_id) == tokenizer.convert_ids_to_tokens(token_id).encode()
    sp = texts["sp-metaspace"]
    byte_a = hf_tokenizers["sp-metaspace"].convert_tokens_to_ids("<0x41>")
    assert sp.piece(byte_a) == b"A" and not sp.is_special(byte_a)
    for name in GGUFS:
        tokenizer, text = gguf_tokenizers[name], texts[name]
        for token_id in {tokenizer.eos_token_id, *tokenizer.stop_token_ids} - {None}:
            assert text.is_special(token_id), (name, token_id)
        for marker in SPECIAL_TEXTS[name]:
            (token_id,) = text.encode(marker)
            assert text.is_special(token_id) and text.piece(token_id) == marker.encode()
        assert not any(text.is_special(i) for i in text.encode("def f(x):\n\treturn x"))
    gemma = texts["gemma-3-270m"]
    assert gemma.is_special(gguf_tokenizers["gemma-3-270m"].bos_token_id)
    # Gemma's runs of newlines are user-defined tokens: text, matched by bytes
    (newlines,) = gemma.encode("\n\n")
    assert gemma.piece(newlines) == b"\n\n" and not gemma.is_special(newlines)
    # Qwen's rows past the trained vocabulary are padding: special, no text
    qwen = texts["qwen2.5-coder-1.5b-instruct"]
    assert qwen.is_special(qwen.vocab_size - 1) and qwen.piece(qwen.vocab_size - 1) == b""


def test_out_of_range_ids_are_refused(texts):
    for text in texts.values():
        for token_id in (-1, text.vocab_size):
            with pytest.raises(TokenOutOfRangeError):
                text.piece(token_id)
            with pytest.raises(TokenOutOfRangeError):
                text.is_special(token_id)


def test_wordpiece_is_refused_with_the_reason():
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=100,
                                                                    special_tokens=["[UNK]"]))
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    with pytest.raises(IncompatibleModelsError, match="WordPiece"):
        token_text(wordpiece)
    with pytest.raises(IncompatibleModelsError, match="expected a transformers tokenizer"):
        token_text(object())


def test_bytes_to_unicode_is_gpt2s_table():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert table[ord(" ")] == "\u0120" and table[ord("\n")] == "\u010a" and table[ord("A")] == "A"


REAL_PAIRS = [("smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"),
              ("gemma-3-270m", "qwen2.5-coder-1.5b-instruct"),
              ("demo", "qwen2.5-coder-1.5b-instruct"),
              ("demo", "smollm2-135m-instruct")]


@pytest.mark.parametrize(("draft", "target"), REAL_PAIRS)
def test_shared_vocabulary_of_real_pairs(texts, draft, target):
    shared = check_cross_pair(texts[draft], texts[target])
    draft_text, target_text = texts[draft], texts[target]
    pairs = list(zip(shared.draft_ids.tolist(), shared.target_ids.tolist()))
    assert all(draft_text.piece(d) == target_text.piece(t) != b"" for d, t in pairs)
    assert all(draft_text.is_special(d) == target_text.is_special(t) for d, t in pairs)
    assert sum(draft_text.is_special(d) for d, _ in pairs) == shared.num_special
    assert len({t for _, t in pairs}) == len(pairs)  # one to one
    # complete: every text piece both spell is mapped
    assert {draft_text.piece(d) for d, t in pairs} == _text_pieces(draft_text) & _text_pieces(
        target_text) | {draft_text.piece(d) for d, _ in pairs if draft_text.is_special(d)}
    lookup = shared.target_of_draft()
    assert lookup[shared.draft_ids].tolist() == shared.target_ids.tolist()
    assert int((lookup >= 0).sum()) == shared.num_shared
    assert shared.draft_coverage == shared.num_shared / draft_text.vocab_size
    print(f"{draft} -> {target}: {shared.num_shared} shared ({shared.num_special} special), "
          f"draft coverage {shared.draft_coverage:.4f}, target {shared.target_coverage:.4f}")


def test_chat_markers_map_by_text_between_smollm2_and_qwen(texts):
    smollm2, qwen = texts["smollm2-135m-instruct"], texts["qwen2.5-coder-1.5b-instruct"]
    table = shared_vocabulary(smollm2, qwen).target_of_draft()
    for marker in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        (draft_id,), (target_id,) = smollm2.encode(marker), qwen.encode(marker)
        assert int(table[draft_id]) == target_id


def test_shared_vocabulary_keeps_the_lowest_id_of_equal_pieces():
    draft = FixtureText([b"a", b"b", b"a", b"<eos>", b"", b"c"], specials={3, 4})
    target = FixtureText([b"c", b"<eos>", b"a", b"a", b"b", b"<eos>", b"z"], specials={5})
    shared = shared_vocabulary(draft, target)
    assert list(zip(shared.draft_ids.tolist(), shared.target_ids.tolist())) == [
        (0, 2), (1, 4), (3, 5), (5, 0)]
    assert shared.num_special == 1 and shared.draft_of_target().tolist() == [
        5, -1, 0, -1, 1, 3, -1]
    assert (shared.draft_coverage, shared.target_coverage) == (4 / 6, 4 / 7)


def test_a_pair_with_no_text_in_common_is_refused():
    draft = FixtureText([b"a", b"<eos>"], specials={1})
    target = FixtureText([b"b", b"<eos>"], specials={1})
    assert shared_vocabulary(draft, target).num_shared == 1
    with pytest.raises(IncompatibleModelsError, match="share no text token"):
        check_cross_pair(draft, target)
    empty = shared_vocabulary(draft, FixtureText([b"z"], specials=set()))
    assert isinstance(empty, VocabMap) and empty.draft_ids.shape == (0,)


@dataclass(frozen=True)
class FixtureText:
    """A TokenText over a list of pieces, encoding one byte per token (letters only)."""

    pieces: list[bytes]
    specials: set[int]

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def piece(self, token_id: int) -> bytes:
        return self.pieces[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self.specials

    def encode(self, text: str) -> list[int]:
        return [self.pieces.index(char.encode()) for char in text]


class DroppedSpaces:
    """A broken SentencePiece TokenText: "\u2581" maps to nothing."""

    def __init__(self, text: TokenText, tokenizer: PreTrainedTokenizerFast) -> None:
        self.vocab_size, self._text, self._tokenizer = text.vocab_size, text, tokenizer

    def piece(self, token_id: int) -> bytes:
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        return token.replace("\u2581", "").encode() if "\u2581" in token else self._text.piece(
            token_id)

    def is_special(self, token_id: int) -> bool:
        return self._text.is_special(token_id)

    def encode(self, text: str) -> list[int]:
        return self._text.encode(text)


def detokenize(tokenizer: LlamaCppTokenizer, ids: list[int]) -> bytes:
    """llama.cpp's own detokenizer: special tokens kept as text, no space clean-up."""
    llama_cpp = bindings()
    tokens = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    size = 16 * len(ids) + 16
    buffer = ctypes.create_string_buffer(size)
    length = llama_cpp.llama_detokenize(tokenizer.model.vocab, tokens, len(ids), buffer, size,
                                        False, True)
    assert 0 <= length <= size
    return buffer.raw[:length]


def _text_pieces(text: TokenText) -> set[bytes]:
    return {text.piece(i) for i in range(text.vocab_size)
            if text.piece(i) and not text.is_special(i)}


def _is_utf8(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
