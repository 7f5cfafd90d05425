"""llama.cpp's own tokenizer of a GGUF file, behind the few methods verispec's text layer calls.

What this is: ``encode`` / ``decode`` / special ids / ``get_vocab`` / the chat template, each
answered by llama.cpp (``llama_tokenize``, ``llama_detokenize``, the vocabulary in the file).
Text is tokenized exactly as llama.cpp's own server does (special tokens added as the file says,
special-token text parsed), so a prompt sent to verispec and to ``llama-server`` conditions on
the same token ids.

What this is not: a transformers tokenizer. The api layer uses only ``encode``, ``decode(ids,
skip_special_tokens=True)``, ``eos_token_id`` / ``stop_token_ids``, ``get_vocab`` and
``len()``; the server also uses ``chat_template`` and ``apply_chat_template`` (rendered by
llama-cpp-python's Jinja2 chat formatter, which follows transformers' rendering).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from .model import LlamaCppModel, bindings


class LlamaCppTokenizer:
    """The vocabulary of one loaded :class:`LlamaCppModel`."""

    def __init__(self, model: LlamaCppModel) -> None:
        llama_cpp = bindings()
        self.model = model  # keeps the vocabulary's memory alive
        self._vocab = model.vocab
        self._size = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self._add_special = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.bos_token_id = _id_or_none(llama_cpp.llama_vocab_bos(self._vocab))
        self.eos_token_id = _id_or_none(llama_cpp.llama_vocab_eos(self._vocab))
        self.pad_token_id = _id_or_none(llama_cpp.llama_vocab_pad(self._vocab))
        self.unk_token_id = None
        # every end-of-generation token (EOS, EOT, <|im_end|>, ...): generation stops at any
        self.stop_token_ids = tuple(t for t in range(self._size)
                                    if llama_cpp.llama_vocab_is_eog(self._vocab, t))
        self.chat_template = model.metadata("tokenizer.chat_template")
        self._vocab_dict: dict[str, int] | None = None
        self._piece_cache: dict[tuple[int, bool], bytes] = {}  # (id, special) -> bytes

    def __len__(self) -> int:
        return self._size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, special-token text parsed as special tokens.
        ``add_special_tokens``: add the BOS token where the model's metadata asks for one (as
        a transformers tokenizer does); False for text that carries its own, such as a chat
        template's rendering."""
        llama_cpp = bindings()
        add_special = self._add_special and add_special_tokens
        data = text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            buffer = (llama_cpp.llama_token * capacity)()
            count = llama_cpp.llama_tokenize(self._vocab, data, len(data), buffer, capacity,
                                             add_special, True)
            if count >= 0:
                return list(buffer[:count])
            capacity = -count

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``: their pieces' bytes joined (special tokens left out when
        ``skip_special_tokens``), decoded as UTF-8; an incomplete character at the end comes out
        as U+FFFD (the detokenizer waits). Joined piece by piece, not by llama_detokenize, whose
        space clean-up ("x ' y" -> "x' y") depends on the whole text, so the text of a window of
        tokens would differ from its share of the whole."""
        return b"".join(self._pieces(int(t), not skip_special_tokens)
                        for t in token_ids).decode("utf-8", errors="replace")

    def _pieces(self, token_id: int, special: bool) -> bytes:
        key = (token_id, special)
        piece = self._piece_cache.get(key)
        if piece is None:
            buffer = ctypes.create_string_buffer(64)
            length = bindings().llama_token_to_piece(self._vocab, token_id, buffer, 64, 0, special)
            if length > 64:
                buffer = ctypes.create_string_buffer(length)
                length = bindings().llama_token_to_piece(self._vocab, token_id, buffer, length,
                                                         0, special)
            piece = self._piece_cache[key] = buffer.raw[:max(length, 0)]
        return piece

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id (llama.cpp's stored text of each token), for comparing vocabularies."""
        if self._vocab_dict is None:
            llama_cpp = bindings()
            self._vocab_dict = {
                llama_cpp.llama_vocab_get_text(self._vocab, t).decode("utf-8", "replace"): t
                for t in range(self._size)}
        return self._vocab_dict

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` under the file's own chat template."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        assert not tokenize and self.chat_template
        formatter = Jinja2ChatFormatter(self.chat_template, self._piece(self.eos_token_id),
                                        self._piece(self.bos_token_id), add_generation_prompt)
        return formatter(messages=messages).prompt

    def _piece(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        text = bindings().llama_vocab_get_text(self._vocab, token_id)
        return text.decode("utf-8", errors="replace")


def _id_or_none(token_id: int) -> int | None:
    return None if token_id < 0 else int(token_id)
