"""Streaming text of generated tokens, exactly as the tokenizer decodes them."""

from typing import List


class Detokenizer:
    """The text of the tokens added so far, equal to ``tokenizer.decode`` of
    them all, handed out a piece at a time (``last_segment``).

    mlx-lm's BPE streaming detokenizer drops a leading space from the first
    token, so a completion's text did not continue its prompt (``def`` then
    ``__init__``, where the tokens say `` __init__``). Here each new piece is
    the decoding of a short window of tokens, less the decoding of the window's
    part already handed out: the window gives a tokenizer that treats a
    token at the start of a text differently (SentencePiece's leading space)
    the same context in both, and a piece that ends inside a UTF-8 character
    waits for the rest of it."""

    def __init__(self, tokenizer):
        self._decode = tokenizer.decode
        self.reset()

    def reset(self) -> None:
        self.tokens: List[int] = []
        self.text = ""
        self._start = 0  # the window: tokens from here on are decoded together
        self._read = 0  # tokens before this are in ``text``
        self._handed = 0  # characters of ``text`` given out by ``last_segment``

    def add_token(self, token: int) -> None:
        self.tokens.append(int(token))
        self._advance(final=False)

    def finalize(self) -> None:
        self._advance(final=True)

    def _advance(self, final: bool) -> None:
        window = self._decode(self.tokens[self._start :])
        if window.endswith("\ufffd") and not final:
            return  # part of a character: wait for its other bytes
        done = self._decode(self.tokens[self._start : self._read])
        self.text += window[len(done) :]
        self._start, self._read = self._read, len(self.tokens)

    @property
    def last_segment(self) -> str:
        """The text added since the last call."""
        piece = self.text[self._handed :]
        self._handed = len(self.text)
        return piece
