"""Incremental detokenization with stop strings, one token at a time.

A byte-level BPE splits one character over several tokens, and SentencePiece-style tokenizers
decode a token differently at the start of a string; so a token's text is the difference between
decoding a short window that ends with it and the same window without it, and it is released
only once it no longer ends in an incomplete character (U+FFFD). The last few characters are held
back while a stop string could still be completing, so no delta ever carries text that a stop
string later removes.
"""

from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """The text of one request's new tokens: `push` each committed token, `take` the safe delta."""

    def __init__(self, tokenizer, stops: Sequence[str] = (), context_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # characters a stop could still claim
        # A few prompt tokens seed the window so the first new token decodes as it would mid-text.
        self.ids: list[int] = list(context_ids)[-4:]
        self.prefix = 0  # window start (index into ids)
        self.read = len(self.ids)  # ids before this are already in `text`
        self.text = ""  # decoded text of the new tokens so far (cut at a stop string once one appears)
        self.sent = 0  # characters of `text` already returned by take()
        self.stopped: str | None = None  # the stop string that ended generation

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> bool:
        """Add one token; True once a stop string has appeared (later tokens are ignored)."""
        if self.stopped is not None:
            return True
        self.ids.append(int(token_id))
        window = self._decode(self.ids[self.prefix:])
        if window.endswith(REPLACEMENT):
            return False  # a character still incomplete: wait for its remaining bytes
        before = self._decode(self.ids[self.prefix:self.read])
        start = len(self.text)
        self.text += window[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        return self._check_stops(start)

    def _check_stops(self, start: int) -> bool:
        if not self.stops:
            return False
        lo = max(0, start - self.hold)  # a stop may begin in text that came earlier
        hits = [i for i in (self.text.find(s, lo) for s in self.stops) if i >= 0]
        if not hits:
            return False
        cut = min(hits)
        self.stopped = next(s for s in self.stops if self.text.find(s, lo) == cut)
        self.text = self.text[:cut]
        return True

    def take(self, final: bool = False) -> str:
        """Text not yet returned that is now certain; everything left when `final` (a character
        still incomplete when generation ended comes out as U+FFFD, as a full decode would)."""
        if final and self.stopped is None and self.read < len(self.ids):
            before = self._decode(self.ids[self.prefix:self.read])
            start = len(self.text)
            self.text += self._decode(self.ids[self.prefix:])[len(before):]
            self.prefix = self.read = len(self.ids)
            self._check_stops(start)  # the last token may complete a stop string before its U+FFFD
        end = len(self.text) if final or self.stopped is not None else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent:end], end
        return delta
