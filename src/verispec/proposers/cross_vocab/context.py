"""A row's draft context: the committed text in the draft's own tokens, kept up to date.

What it is: the committed target tokens' bytes (TokenText.piece), decoded as UTF-8 as they
come, and the draft tokenizer's encoding of that text (``ids``), which the draft model is fed.
A special target token reaches the draft as its text (<|im_start|>), which the draft's
``encode`` parses as its own special token of that text where it has one, else as text.

What it is not: what the proposal is made of (rules.py), or the draft model's cache
(session.py keeps that a prefix of ``ids``, rewinding it where ``ids`` changed).

Incremental. Re-encoding the whole text after each commit would cost a row its whole history
every round; instead the last TAIL_TOKENS draft tokens and the new text are re-encoded (BPE
merges and pre-tokenizer splits reach only a few tokens back; where they would reach further,
the draft sees a valid but uncanonical tokenization: a cost in acceptance, never in
exactness). The window starts at a token end that is a character boundary of the text (a
byte-level token may end inside a character) and that the pieces before it spell (a
tokenizer that normalises text, or writes an unknown token, leaves ends it cannot place);
where none of the last TAIL_TOKENS qualifies, nearer, at the latest where the text encoded
before ended. Bytes of an unfinished character are held back (``pending``) until the
character completes; bytes that are not UTF-8 reach the draft as U+FFFD.

Worked example (draft tokens "hel" "lo", TAIL_TOKENS = 1): committed "hello" -> ids [hel, lo];
commit " wor" -> re-encode "lo wor" from byte 3 -> ids [hel, lo, " wor"]; commit "ld" ->
re-encode " world" from byte 5 -> ids [hel, lo, " world"], changed from index 2.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from ...models.base import TokenText

# draft tokens re-encoded with each commit's new text (the tail window)
TAIL_TOKENS = 4


class DraftContext:
    """One row's committed text as draft token ids. ``prefix``: draft ids the context starts
    with (its BOS), never re-encoded."""

    def __init__(self, draft_text: TokenText, prefix: Sequence[int] = ()) -> None:
        self.draft_text = draft_text
        self.num_prefix = len(prefix)
        self.ids: list[int] = list(prefix)  # what the draft model should have seen
        # each id's end in _text, or -1 where the pieces did not spell the text encoded (a
        # tokenizer that normalises): no window starts there
        self._ends: list[int] = [0] * len(prefix)
        self._text = bytearray()  # the committed text decoded so far, as UTF-8
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    @property
    def pending(self) -> bytes:
        """The committed bytes of an unfinished character, held back from the draft."""
        return self._decoder.getstate()[0]

    def append(self, data: bytes) -> int:
        """Committed bytes join the text; -> the first index of ``ids`` that may have changed
        (len(ids) where none did)."""
        text = self._decoder.decode(data)
        if not text:
            return len(self.ids)
        self._text += text.encode()
        return self._encode_tail()

    def _encode_tail(self) -> int:
        first = self._window_start()
        start = self._ends[first - 1] if first > self.num_prefix else 0
        new_ids = self.draft_text.encode(self._text[start:].decode())
        self.ids[first:] = new_ids
        self._ends[first:] = self._token_ends(new_ids, start)
        return first

    def _window_start(self) -> int:
        """The first id to re-encode: TAIL_TOKENS back, or nearer where no window may start
        there; the end of the text encoded before (always a boundary) at the nearest."""
        for first in range(max(self.num_prefix, len(self.ids) - TAIL_TOKENS), len(self.ids)):
            if first == self.num_prefix or self._starts_window(first - 1):
                return first
        return len(self.ids)

    def _starts_window(self, index: int) -> bool:
        """Whether a window may start after token ``index``: its end is known and begins a
        character (not a UTF-8 continuation byte)."""
        end = self._ends[index]
        return end >= 0 and (end == len(self._text) or self._text[end] & 0xC0 != 0x80)

    def _token_ends(self, ids: list[int], start: int) -> list[int]:
        """The ends in _text of ``ids``, the encoding of _text[start:]: known while their
        pieces spell the text, -1 from the first that does not (a tokenizer that normalises,
        an unknown token), and the text's end for the last."""
        ends, end, spelled = [], start, True
        for token_id in ids:
            piece = self.draft_text.piece(token_id)
            spelled = spelled and self._text[end: end + len(piece)] == piece
            end += len(piece)
            ends.append(end if spelled else -1)
        if ends:
            ends[-1] = len(self._text)
        return ends
