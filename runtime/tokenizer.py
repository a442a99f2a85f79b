"""Text <-> token ids for an artifact, through the `tokenizers` library and the artifact's tokenizer.json.

Besides encode/decode this gives streaming-safe detokenization (`Tokenizer.stream()`): text is
released only once it is final, so a client never sees half of a multi-byte UTF-8 character, and
special-token ids by name (`Tokenizer.token_id("<|im_end|>")`).

Byte-level BPE tokenizers (Qwen, GPT-2 style) are decoded from a per-id byte table through an
incremental UTF-8 decoder, which is exact. Other tokenizers (word-level test fixtures) fall back to
re-decoding a short window of recent ids and holding text back while it ends in U+FFFD.
"""
from __future__ import annotations

import codecs
import json
import threading
from array import array
from collections import OrderedDict
from functools import cached_property


def added_ids(tokenizer: dict) -> list[int]:
    """The ids of a tokenizer's (tokenizer.json, parsed) added tokens: <|im_end|>, <think>, the tool-call tags, ..."""
    return sorted(t["id"] for t in tokenizer.get("added_tokens", []))


def id_domain(tokenizer: dict, vocab: int) -> int:
    """Ids a tokenizer (tokenizer.json, parsed) can produce among a model's `vocab` rows (engine.token_domain)."""
    ids = list(tokenizer.get("model", {}).get("vocab", {}).values()) + added_ids(tokenizer)
    size = max(ids) + 1 if ids else 0
    return min(vocab, size) if size >= vocab // 2 else vocab


class TokenizerError(ValueError):
    """The tokenizer resource is missing or unreadable."""


def _byte_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable-character map (the GPT-2 convention: the
    printable Latin-1 bytes stand for themselves, the other 68 bytes are shifted to U+0100...)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = {b: b for b in keep}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shift
            shift += 1
    return {chr(c): b for b, c in chars.items()}


def _is_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return decoder.get("type") == "Sequence" and any(_is_byte_level(d) for d in decoder.get("decoders", []))


class Tokenizer:
    """One tokenizer.json (plus the optional tokenizer_config.json for the eos/pad names)."""

    def __init__(self, tokenizer_json: bytes | str, tokenizer_config: bytes | str | dict | None = None,
                 source: str = "tokenizer.json"):
        from tokenizers import Tokenizer as HFTokenizer
        text = tokenizer_json.decode("utf-8") if isinstance(tokenizer_json, bytes) else tokenizer_json
        try:
            self._tok = HFTokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception subclasses
            raise TokenizerError(f"{source}: not a readable tokenizers file: {e}") from None
        if isinstance(tokenizer_config, (bytes, str)):
            try:
                tokenizer_config = json.loads(tokenizer_config)
            except ValueError as e:
                raise TokenizerError(f"tokenizer_config.json: not valid JSON: {e}") from None
        self.config: dict = tokenizer_config if isinstance(tokenizer_config, dict) else {}
        self.source = source

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_artifact(cls, art) -> "Tokenizer":
        """The tokenizer embedded in an opened artifact (`TokenizerError` if it carries none)."""
        try:
            data = art.resource("tokenizer.json")
        except KeyError:
            raise TokenizerError(f"{art.path}: the artifact carries no tokenizer.json; "
                                 "give token ids instead of text") from None
        try:
            cfg = art.resource("tokenizer_config.json")
        except KeyError:
            cfg = None
        return cls(data, cfg, source=f"{art.path}:tokenizer.json")

    @classmethod
    def from_file(cls, path, config_path=None) -> "Tokenizer":
        from pathlib import Path
        p = Path(path)
        cfg = Path(config_path).read_bytes() if config_path else None
        return cls(p.read_bytes(), cfg, source=str(p))

    # -- basics --------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """One past the largest id (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as is: special-token strings in the text become their ids (the chat
        template relies on this), and nothing is added around it (no BOS/EOS)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_id(self, name: str) -> int | None:
        """Id of a token by its text (e.g. "<|im_end|>", "<think>"), or None if the vocabulary lacks it."""
        return self._tok.token_to_id(name)

    def id_to_token(self, token: int) -> str | None:
        return self._tok.id_to_token(token)

    @cached_property
    def added_tokens(self) -> dict[str, int]:
        """Every added token (specials such as <|im_start|>, and markers such as <think>) by name."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the tokens flagged special (dropped by decode(skip_special=True))."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def _config_token(self, key: str) -> str | None:
        v = self.config.get(key)
        if isinstance(v, dict):          # older configs store AddedToken dicts
            v = v.get("content")
        return v if isinstance(v, str) else None

    @property
    def eos_id(self) -> int | None:
        """tokenizer_config's eos_token as an id (None when unset or not in the vocabulary)."""
        name = self._config_token("eos_token")
        return self.token_id(name) if name else None

    @property
    def pad_id(self) -> int | None:
        name = self._config_token("pad_token")
        return self.token_id(name) if name else None

    # -- streaming -----------------------------------------------------------------------------
    @cached_property
    def _id_bytes(self) -> list[bytes | None] | None:
        """Per-id bytes for byte-level BPE (None for other tokenizers)."""
        decoder = self._tok.decoder
        if decoder is None or not _is_byte_level(json.loads(decoder.__getstate__())):
            return None
        table: list[bytes | None] = [None] * self.vocab_size
        to_latin1 = {ord(c): b for c, b in _byte_decoder().items()}   # piece chars -> byte values
        for piece, i in self._tok.get_vocab(with_added_tokens=False).items():
            if 0 <= i < len(table):
                try:
                    table[i] = piece.translate(to_latin1).encode("latin-1")
                except UnicodeEncodeError:   # not a byte-level piece: let the library decode it
                    table[i] = self._tok.decode([i], skip_special_tokens=False).encode("utf-8")
        for i, t in self._tok.get_added_tokens_decoder().items():
            if 0 <= i < len(table):
                table[i] = t.content.encode("utf-8")
        return table

    def stream(self, skip_ids=()) -> "StreamDecoder":
        """A fresh incremental detokenizer; ids in `skip_ids` (e.g. the stop token) produce no text."""
        return StreamDecoder(self, frozenset(skip_ids))


class TurnEncoder:
    """Token ids of chat prompts that encode each turn once. A prompt is cut before every `mark` (the template's
    turn opener): the tokenizer itself splits text at that added token and strips nothing around it, so the ids
    of the pieces, concatenated, are the ids of the whole. The pieces' ids are kept (least recently used out past
    `max_tokens`), so a conversation's next turn encodes only its new turns: a 32K-token history costs ~65 ms
    of encoding on a 2-core VM, which would be most of a next turn's time to first token once its prefill is
    cached. Without such a mark it encodes the whole text, as Tokenizer.encode does."""

    def __init__(self, tok: Tokenizer, mark: str = "<|im_start|>", max_tokens: int = 4 << 20):
        self.tok, self.mark, self.max_tokens = tok, mark, max_tokens
        mark_id = tok.token_id(mark)
        t = tok._tok.get_added_tokens_decoder().get(mark_id) if mark_id is not None else None
        self.exact = t is not None and not (t.lstrip or t.rstrip or t.single_word or t.normalized)
        self._pieces: OrderedDict[str, array] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()   # prompts are built on executor threads

    def encode(self, text: str) -> list[int]:
        if not self.exact:
            return self.tok.encode(text)
        ids: list[int] = []
        start = 0
        while start < len(text):
            cut = text.find(self.mark, start + 1)
            piece = text[start:cut if cut >= 0 else len(text)]
            ids += self._piece(piece)
            start += len(piece)
        return ids

    def _piece(self, piece: str) -> array:
        with self._lock:
            got = self._pieces.get(piece)
            if got is not None:
                self._pieces.move_to_end(piece)
                return got
        got = array("i", self.tok.encode(piece))
        with self._lock:
            if piece not in self._pieces:
                self._pieces[piece] = got
                self._tokens += len(got)
            while self._tokens > self.max_tokens and self._pieces:
                self._tokens -= len(self._pieces.popitem(last=False)[1])
        return got


class StreamDecoder:
    """Feed ids one at a time; get back only text that is final (complete characters).

    `push(id)` returns the newly final text (possibly ""); `finish()` returns whatever is still held
    (an incomplete UTF-8 tail becomes U+FFFD there). Concatenating every return value equals
    `decode(all ids)` for byte-level tokenizers."""

    def __init__(self, tok: Tokenizer, skip_ids: frozenset = frozenset()):
        self.tok, self.skip = tok, skip_ids
        self.table = tok._id_bytes
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.ids: list[int] = []
        self.prefix = 0     # fallback: ids[prefix:read] already produced text
        self.read = 0

    def push(self, token: int) -> str:
        if token in self.skip:
            return ""
        if self.table is not None:
            piece = self.table[token] if 0 <= token < len(self.table) else None
            return self.utf8.decode(piece if piece is not None else b"")
        return self._push_fallback(token)

    def _push_fallback(self, token: int) -> str:
        # Re-decode from the previous release point: decoders that join pieces (spaces between words,
        # merged byte pieces) only come out right with some left context.
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        # A UTF-8 character spans at most 4 byte tokens: a U+FFFD still there after 4 is real.
        if len(after) <= len(before) or (after.endswith("\ufffd") and len(self.ids) - self.read < 4):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def finish(self) -> str:
        if self.table is not None:
            return self.utf8.decode(b"", final=True)
        out = ""
        if self.read < len(self.ids):
            before = self.tok.decode(self.ids[self.prefix:self.read])
            out = self.tok.decode(self.ids[self.prefix:])[len(before):]
            self.read = len(self.ids)
        return out


class StopStrings:
    """Watch streamed text for stop strings. `feed(text)` returns (text safe to release, hit): text
    that could still be the start of a stop string is held back, and on a hit the text is cut just
    before the stop string (which is never released). `finish()` releases what is held."""

    def __init__(self, stops=()):
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.hit: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if self.hit is not None:
            return "", True
        if not self.stops:
            return text, False
        self.buf += text
        found = [(self.buf.find(s), s) for s in self.stops]
        found = [(i, s) for i, s in found if i >= 0]
        if found:
            i, self.hit = min(found)
            out, self.buf = self.buf[:i], ""
            return out, True
        # hold back the longest tail that is a prefix of some stop string
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.buf)), keep, -1):
                if s.startswith(self.buf[-n:]):
                    keep = n
                    break
        out = self.buf[:len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep:]
        return out, False

    def finish(self) -> str:
        out, self.buf = ("" if self.hit is not None else self.buf), ""
        return out


__all__ = ["Tokenizer", "TokenizerError", "StreamDecoder", "StopStrings"]
