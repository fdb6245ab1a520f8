"""Streaming detokenization: turn one token id at a time into finished text.

The technique is the prefix-offset / read-offset window of vLLM and TGI. Ids are kept in a list;
two offsets split it:

    ids:   [ ... emitted, no longer decoded ... | prefix window | pending (not yet emitted) ]
                                                ^ prefix        ^ read                    ^ len(ids)

On each push, `decode(ids[prefix:])` is compared with `decode(ids[prefix:read])`. The prefix
window is left context only: it makes the decoder see the same neighbourhood it sees in a full
decode (a sentencepiece `▁` is stripped only at the very start of a decode, byte-level tokens
join into characters), so the difference between the two decodes is exactly the new text. When
the new text ends in U+FFFD the last character may still be incomplete (a multi-byte character
split across tokens), so nothing is emitted and the window keeps growing until it completes.
When text is emitted, `prefix` moves to the old `read` and `read` to the end, so each step decodes
a window of a few tokens: O(1) per token for valid text. (A long run of truly invalid bytes keeps
the window open until a valid character follows; it costs O(run) per token, never wrong text.)

A ByteFallback decoder (sentencepiece-style `<0xE4>` byte tokens) is not local: one invalid byte
turns its whole run of consecutive byte tokens into U+FFFD. So while the last token is a byte
token nothing is emitted; the run's text comes out with the first non-byte token (or at flush).

With `skip_special_tokens`, special ids are dropped before they enter the window, which is what
`tokenizers` does before decoding, so a skipped token can never become the "start" of a window.

Contract: `"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids, skip_special_tokens)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from onnxgen.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streams the text of a growing token sequence. One instance per generated sequence; not
    thread-safe (each push mutates the window).

    `push(id)` returns the newly finalised text ("" while a multi-byte character is incomplete or the
    token adds no text); `flush()` returns whatever is left at the end (U+FFFD only for bytes that
    are truly invalid); `text` is everything emitted so far.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._special = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer.byte_fallback_ids
        self._ids: list[int] = []
        self._prefix = 0  # start of the left-context window
        self._read = 0  # end of the emitted part
        self._prefix_text = ""  # decode(ids[prefix:read]), cached
        self._chunks: list[str] = []
        self._fallbacks = 0

    @property
    def text(self) -> str:
        """Everything emitted so far (by push and flush)."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Ids pushed so far (without skipped special ids)."""
        return tuple(self._ids)

    @property
    def resyncs(self) -> int:
        """How often a window decode disagreed with its prefix and a full decode was used instead
        (0 for every tokenizer onnxgen has been tested with; kept as a safety net, see `push`)."""
        return self._fallbacks

    @property
    def pending_tokens(self) -> int:
        """Tokens pushed whose text has not been emitted yet."""
        return len(self._ids) - self._read

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _emit(self, piece: str) -> str:
        if piece:
            self._chunks.append(piece)
        return piece

    def push(self, token_id: int) -> str:
        """Add one token; return the text it finalises (possibly "")."""
        if token_id in self._special:
            return ""
        self._ids.append(int(token_id))
        if token_id in self._byte_ids:
            return ""  # a byte run is final only once a non-byte token closes it
        new_text = self._decode(self._ids[self._prefix :])
        if new_text.endswith(_REPLACEMENT) or len(new_text) <= len(self._prefix_text):
            return ""
        if new_text.startswith(self._prefix_text):
            piece = new_text[len(self._prefix_text) :]
        else:
            # NOTE: the decoder is not local at this boundary (never seen with BPE/byte-level or
            # metaspace decoders); resynchronise from a full decode so the output stays exact.
            self._fallbacks += 1
            full = self._decode(self._ids)
            if full.endswith(_REPLACEMENT):
                return ""
            emitted = self.text
            if not full.startswith(emitted):  # pragma: no cover - would need a non-prefix-stable decoder
                raise AssertionError("incremental detokenization diverged from the full decode")
            piece = full[len(emitted) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        return self._emit(piece)

    def flush(self) -> str:
        """Emit the rest (an incomplete trailing character decodes to U+FFFD, as a full decode would).
        Call it once, at the end of the sequence."""
        if self._read == len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix :])
        if new_text.startswith(self._prefix_text):
            piece = new_text[len(self._prefix_text) :]
        else:
            self._fallbacks += 1
            piece = self._decode(self._ids)[len(self.text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        return self._emit(piece)
