"""A tokenizer over Hugging Face `tokenizers` (`tokenizer.json`), with special tokens from
`tokenizer_config.json` and the package's `genai_config.json`.

Semantics follow transformers v5 loading a folder with a `tokenizer.json`: the tokenizer's own
post-processor decides which special tokens `encode` adds (transformers then ignores
`add_bos_token` / `add_eos_token` in tokenizer_config, and so does onnxgen). Decoding is the
`tokenizers` decoder with no extra clean-up of spaces, so that streaming (see `detok.py`) can
reproduce it exactly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onnxgen.errors import MissingTokenizer

if TYPE_CHECKING:
    import tokenizers

    from onnxgen.package.spec import ModelSpec


def token_str(value: Any) -> str | None:
    """A special-token entry of tokenizer_config (a string or an AddedToken dict) as a string."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


_BYTE_DECODER: dict[str, int] = {}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character standing for each byte -> the byte."""
    if not _BYTE_DECODER:
        keep = [
            *range(ord("!"), ord("~") + 1),
            *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), 256),
        ]
        extra = 0
        for b in range(256):
            if b in keep:
                _BYTE_DECODER[chr(b)] = b
            else:
                _BYTE_DECODER[chr(256 + extra)] = b
                extra += 1
    return _BYTE_DECODER


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MissingTokenizer(f"{path}: not valid JSON ({exc}); fix or regenerate the file", path) from exc
    if not isinstance(data, dict):
        raise MissingTokenizer(f"{path}: must hold a JSON object", path)
    return data


class Tokenizer:
    """Text <-> token ids for one model. Immutable after construction and safe to share across threads
    for encode/decode (the underlying `tokenizers.Tokenizer` is only read).

    Attributes:
        vocab_size: size of the vocabulary including added tokens.
        bos_token / eos_token: the strings chat templates see (from tokenizer_config, else derived from ids).
        bos_token_id: id of `bos_token` (else the package's `bos_token_id`).
        eos_token_ids: union of tokenizer_config's EOS and the package's EOS ids, in that order.
        special_ids: ids of the added tokens flagged special, i.e. exactly the ids that
            `decode(..., skip_special_tokens=True)` drops.
        byte_fallback_ids: the `<0xXX>` byte tokens of a ByteFallback decoder (empty otherwise).
        config: the raw tokenizer_config dict (read-only by convention).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any] | None = None,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        """Wrap a `tokenizers.Tokenizer`. `config` is tokenizer_config.json's dict; `bos_token_id` and
        `eos_token_ids` are the package's ids (genai_config), used when the config names none / merged in.
        The backend object is not modified."""
        self._tok = backend
        self.config: dict[str, Any] = dict(config or {})
        cfg = self.config

        bos = token_str(cfg.get("bos_token"))
        if bos is None and bos_token_id is not None:
            bos = backend.id_to_token(bos_token_id)
        self.bos_token: str | None = bos
        bid = backend.token_to_id(bos) if bos is not None else None
        self.bos_token_id: int | None = bid if bid is not None else bos_token_id

        eos = token_str(cfg.get("eos_token"))
        ids: list[int] = []
        eid = backend.token_to_id(eos) if eos is not None else None
        if eid is not None:
            ids.append(eid)
        for i in eos_token_ids:
            if i not in ids:
                ids.append(int(i))
        if eos is None and ids:
            eos = backend.id_to_token(ids[0])
        self.eos_token: str | None = eos
        self.eos_token_ids: tuple[int, ...] = tuple(ids)

        added = backend.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.byte_fallback_ids: frozenset[int] = self._byte_fallback_ids()
        self._added: frozenset[int] = frozenset(added)
        self._table: list[bytes] | None = None
        self._special: tuple[bytes, ...] | None = None
        dec = backend.decoder
        self._byte_level = dec is not None and b"ByteLevel" in dec.__getstate__()

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> Tokenizer:
        """The tokenizer of a loaded package (its tokenizer.json, tokenizer_config and EOS/BOS ids).
        Raises MissingTokenizer when tokenizer.json cannot be read."""
        return cls(
            cls._load_backend(Path(spec.tokenizer_path)),
            spec.tokenizer_config,
            bos_token_id=spec.bos_token_id,
            eos_token_ids=spec.eos_token_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Read `tokenizer.json` (required), `tokenizer_config.json` and, if present, the BOS/EOS ids of
        `genai_config.json` from a folder. Raises MissingTokenizer naming the file at fault."""
        root = Path(path).expanduser()
        tok_path = root / "tokenizer.json"
        if not tok_path.is_file():
            raise MissingTokenizer(
                f"{tok_path}: missing; copy the model's tokenizer.json into {root}", tok_path
            )
        cfg_path = root / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
        bos_id: int | None = None
        eos_ids: list[int] = []
        genai = root / "genai_config.json"
        if genai.is_file():
            try:
                model = json.loads(genai.read_text(encoding="utf-8")).get("model", {})
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                model = {}
            if isinstance(model, dict):
                b = model.get("bos_token_id")
                bos_id = b if isinstance(b, int) and not isinstance(b, bool) else None
                e = model.get("eos_token_id")
                eos_ids = [
                    v
                    for v in (e if isinstance(e, list) else [e])
                    if isinstance(v, int) and not isinstance(v, bool)
                ]
        return cls(cls._load_backend(tok_path), cfg, bos_token_id=bos_id, eos_token_ids=eos_ids)

    @staticmethod
    def _load_backend(path: Path) -> tokenizers.Tokenizer:
        import tokenizers

        if not path.is_file():
            raise MissingTokenizer(f"{path}: missing; copy the model's tokenizer.json into the package", path)
        try:
            return tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise MissingTokenizer(
                f"{path}: cannot be read by `tokenizers` ({exc}); regenerate it", path
            ) from exc

    def _byte_fallback_ids(self) -> frozenset[int]:
        """Ids of the `<0xXX>` byte tokens when the decoder has a ByteFallback step, else empty.

        NOTE: ByteFallback decodes a run of consecutive byte tokens together and, if the run is not
        valid UTF-8, turns *every* byte of the run into U+FFFD, so text from such a run is final only
        once a non-byte token ends it. The streaming detokenizer needs these ids to honour that.
        """
        dec = self._tok.decoder
        if dec is None or b"ByteFallback" not in dec.__getstate__():
            return frozenset()
        ids = (self._tok.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in ids if i is not None)

    # --- encode / decode ------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (do not mutate it)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token strings inside `text` map to their ids (as in transformers).
        `add_special_tokens` applies the post-processor (e.g. a BOS); raw prompts usually want True,
        rendered chat templates (which carry their own markers) usually False."""
        if not isinstance(text, str):
            from onnxgen.errors import InvalidRequest

            raise InvalidRequest(f"text to encode must be a str, got {type(text).__name__}", field="prompt")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` through the tokenizer's decoder (no clean-up of spaces). Invalid UTF-8 byte
        runs become U+FFFD. With `skip_special_tokens`, ids in `special_ids` are dropped first."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for on its own (what OpenAI's logprobs `bytes` carry): a byte-level
        BPE token's bytes through GPT-2's byte alphabet, a `<0xXX>` byte-fallback token's one byte, a
        SentencePiece piece with its `▁` as a space, an added token's text. Several tokens of one
        multi-byte character each carry their part, so concatenating a sequence's bytes rebuilds its text."""
        piece = self._tok.id_to_token(int(i))
        if piece is None:
            return b""
        if int(i) in self._added:
            return piece.encode("utf-8")
        if self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if int(i) in self.byte_fallback_ids:
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def encode_after(self, text: str, held: Sequence[int]) -> list[int]:
        """Token ids of `text` (no special tokens added) that keep as much of `held` as spells its start.

        `held` are ids a cache already holds (an earlier prompt and the reply the model generated). When the
        start of `text` is exactly the text of `held[:k]`, the result is `held[:k]` + the encoding of the
        rest of `text`: the same text, in the ids the model itself produced, where plain `encode` might split
        the reply differently (a reply's text does not always re-tokenize into the ids that were sampled).
        "The text of" ids is their bytes decoded as `decode` does, each invalid UTF-8 sequence a sampled
        reply may hold becoming U+FFFD, so a client that echoes such a reply still keeps every id.
        The split falls between whole characters, and either all of `held` spells the start of `text` (the
        reply ends the cache) or the split is before a special token (a turn's end marker): never inside
        text that plain encoding would tokenize across the split, so the rest of a prompt is tokenized as a
        fresh run would (a new prompt "client 10" after a held "client 1" is not split into "client 1" +
        "0"). With no such `k` > 0 this is plain `encode`."""
        import numpy as np

        if not held:
            return self.encode(text, add_special_tokens=False)
        table = self.bytes_table()
        pieces = [table[i] if 0 <= i < len(table) else b"" for i in held]
        raw = text.encode("utf-8")
        whole = b"".join(pieces)
        try:
            whole.decode("utf-8")
            ends = np.cumsum([len(p) for p in pieces])  # ends[j]: bytes spelled by held[: j + 1]
            inside = np.frombuffer(whole + b"\0", dtype=np.uint8)[ends] & 0xC0 == 0x80  # mid-character ends
            ends[inside] = -1
        except UnicodeDecodeError:
            whole, ends = _lossy_spelling(pieces)
        n = min(len(raw), len(whole))
        diff = np.flatnonzero(
            np.frombuffer(raw[:n], dtype=np.uint8) != np.frombuffer(whole[:n], dtype=np.uint8)
        )
        common = int(diff[0]) if diff.size else n  # bytes of text spelled by held's text
        k = int(np.searchsorted(np.maximum.accumulate(ends), common, side="right"))  # tokens inside common
        while k > 0 and ends[k - 1] < 0:
            k -= 1  # the last of them that ends between characters
        if k == 0:
            return self.encode(text, add_special_tokens=False)
        cut = int(ends[k - 1])
        if common < len(whole) and not raw[cut:].startswith(self._special_bytes()):
            return self.encode(text, add_special_tokens=False)
        return list(held[:k]) + self.encode(raw[cut:].decode("utf-8"), add_special_tokens=False)

    def _special_bytes(self) -> tuple[bytes, ...]:
        """The UTF-8 text of every special added token (turn markers, EOS...), built once."""
        if self._special is None:
            added = self._tok.get_added_tokens_decoder().values()
            self._special = tuple(t.content.encode("utf-8") for t in added if t.special and t.content)
        return self._special

    def bytes_table(self) -> list[bytes]:
        """`token_bytes` of every id, built once and kept."""
        if self._table is None:
            self._table = [self.token_bytes(i) for i in range(self.vocab_size)]
        return self._table

    def token_to_id(self, tok: str) -> int | None:
        return self._tok.token_to_id(tok)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def special_tokens(self) -> dict[str, str]:
        """Named special tokens of tokenizer_config (`bos_token`, `eos_token`, `unk_token`, `pad_token`,
        ...) as strings; the variables a chat template sees besides the messages."""
        out: dict[str, str] = {}
        for key, value in self.config.items():
            if key.endswith("_token") and (s := token_str(value)) is not None:
                out[key] = s
        if self.bos_token is not None:
            out["bos_token"] = self.bos_token
        if self.eos_token is not None:
            out["eos_token"] = self.eos_token
        return out

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
            f"eos_ids={self.eos_token_ids})"
        )


def _lossy_spelling(pieces: Sequence[bytes]) -> tuple[bytes, Any]:
    """The UTF-8 text that `pieces` decode to with each invalid sequence replaced by U+FFFD (as `decode` does),
    and, per piece, the byte length of that text up to the piece's end (-1 where it ends inside a character)."""
    import codecs

    import numpy as np

    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    out: list[bytes] = []
    ends = np.empty(len(pieces), dtype=np.int64)
    size = 0
    for j, piece in enumerate(pieces):
        part = decoder.decode(piece).encode("utf-8")
        out.append(part)
        size += len(part)
        ends[j] = -1 if decoder.getstate()[0] else size
    out.append(decoder.decode(b"", final=True).encode("utf-8"))  # an incomplete character at the very end
    return b"".join(out), ends
