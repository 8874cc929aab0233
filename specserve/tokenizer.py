"""Tokenizer (from a GGUF file or an HF directory), chat template, incremental detokenizer.

``Tokenizer`` wraps a ``tokenizers.Tokenizer``. From a GGUF file it is rebuilt from the stored
vocabulary, merges and token types (byte-level BPE only), with the pre-tokenizer llama.cpp uses for
the file's ``tokenizer.ggml.pre``. ``TextStreamer`` turns generated ids into final text deltas,
holding back incomplete UTF-8 characters and possible beginnings of stop strings.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from specserve.config import end_of_generation_ids

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 2, 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre values -> how llama.cpp splits text before BPE.
_PRE_GPT2 = ("gpt2", "default", "mpt", "olmo", "jais")
_PRE_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_PRE_LLAMA3 = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "pixtral")
_PRE_QWEN2 = ("qwen2", "deepseek-r1-qwen", "megrez")
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Encode/decode, special tokens and the chat template of one model."""

    def __init__(self, backend: BackendTokenizer, *, bos_token: str | None, eos_token: str | None,
                 eos_token_ids: tuple[int, ...], chat_template: str | None) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    # ---- loading -----------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        """From a .gguf file or an HF directory holding tokenizer.json (+ tokenizer_config.json)."""
        path = Path(path)
        if path.is_file() and path.suffix.lower() == ".gguf":
            return cls.from_gguf(path)
        if path.is_dir() and (path / "tokenizer.json").is_file():
            return cls.from_hf_dir(path)
        raise FileNotFoundError(f"no tokenizer at {path}: expected a .gguf file or a directory "
                                f"with tokenizer.json")

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        from specserve.loading.gguf import open_gguf

        meta = _GgufTokenizerMetadata.read(open_gguf(path))
        backend = build_gguf_backend(meta)
        eos_id = meta.eos_token_id
        return cls(
            backend,
            bos_token=meta.token_text(meta.bos_token_id),
            eos_token=meta.token_text(eos_id),
            eos_token_ids=end_of_generation_ids(eos_id, special_token_ids(backend)),
            chat_template=meta.chat_template,
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        directory = Path(path)
        backend = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")
        bos_token, eos_token = _token_content(config.get("bos_token")), _token_content(config.get("eos_token"))
        declared = _declared_eos_ids(directory) + [backend.token_to_id(eos_token) if eos_token else None]
        end_of_generation = end_of_generation_ids(None, special_token_ids(backend))
        eos_ids = dict.fromkeys(i for i in [*declared, *end_of_generation] if i is not None)
        return cls(
            backend,
            bos_token=bos_token,
            eos_token=eos_token,
            eos_token_ids=tuple(eos_ids),
            chat_template=_hf_chat_template(directory, config),
        )

    # ---- encode / decode ---------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token text such as ``<|im_start|>`` maps to its id."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` as stored (byte-level spelling, e.g. ``Ġthe``)."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, piece: str) -> int | None:
        return self.backend.token_to_id(piece)

    @property
    def special_token_ids(self) -> dict[str, int]:
        """``{text: id}`` of the special (control) tokens."""
        return special_token_ids(self.backend)

    # ---- chat ----------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """Render the conversation as the prompt text the model was trained on."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        template = _compile_chat_template(self.chat_template)
        return template.render(
            messages=[_flatten_message(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **template_kwargs,
        )


# ---- GGUF -> tokenizers.Tokenizer ------------------------------------------------------------

class _GgufTokenizerMetadata:
    """The ``tokenizer.*`` keys of a GGUF file."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.model: str = fields.get("tokenizer.ggml.model", "")
        self.pre: str = fields.get("tokenizer.ggml.pre") or "default"
        self.tokens: list[str] = fields["tokenizer.ggml.tokens"]
        self.token_types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(self.tokens)
        self.merges: list[str] = fields.get("tokenizer.ggml.merges") or []
        self.bos_token_id: int | None = fields.get("tokenizer.ggml.bos_token_id")
        self.eos_token_id: int | None = fields.get("tokenizer.ggml.eos_token_id")
        self.add_bos_token: bool = bool(fields.get("tokenizer.ggml.add_bos_token", False))
        self.chat_template: str | None = fields.get("tokenizer.chat_template")

    @classmethod
    def read(cls, reader) -> "_GgufTokenizerMetadata":
        return cls({key: field.contents() for key, field in reader.fields.items()
                    if key.startswith("tokenizer.")})

    def token_text(self, token_id: int | None) -> str | None:
        return self.tokens[token_id] if token_id is not None and 0 <= token_id < len(self.tokens) else None


def build_gguf_backend(meta: _GgufTokenizerMetadata) -> BackendTokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` equivalent to llama.cpp's for this vocabulary."""
    if meta.model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {meta.model!r} is not supported (only byte-level BPE, 'gpt2')")
    vocab = {_vocab_spelling(token, kind): index
             for index, (token, kind) in enumerate(zip(meta.tokens, meta.token_types))}
    merges = [tuple(merge.split(" ", 1)) for merge in meta.merges]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=meta.pre in _PRE_LLAMA3))
    backend.pre_tokenizer = gguf_pre_tokenizer(meta.pre)
    backend.decoder = decoders.ByteLevel()
    _add_gguf_special_tokens(backend, meta)
    if meta.add_bos_token and meta.bos_token_id is not None:
        bos = meta.tokens[meta.bos_token_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, meta.bos_token_id)])
    return backend


def gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split llama.cpp applies for ``tokenizer.ggml.pre`` (unknown values: GPT-2's, with a warning)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _PRE_LLAMA3:
        return _split_then_bytes(_LLAMA3_SPLIT)
    if pre in _PRE_QWEN2:
        return _split_then_bytes(_QWEN2_SPLIT)
    if pre not in _PRE_GPT2:
        logger.warning("unknown GGUF pre-tokenizer %r: splitting text like GPT-2", pre)
    return byte_level


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _vocab_spelling(token: str, token_type: int) -> str:
    """Normal tokens are stored in the byte-level alphabet; respell any that are not."""
    if token_type in (TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
        return token
    if all(char in _unicode_to_byte() for char in token):
        return token
    return "".join(_byte_to_unicode()[byte] for byte in token.encode("utf-8"))


def _add_gguf_special_tokens(backend: BackendTokenizer, meta: _GgufTokenizerMetadata) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens."""
    pairs = list(zip(meta.tokens, meta.token_types))
    special = [AddedToken(token, special=True, normalized=False)
               for token, kind in pairs if kind in (TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL)]
    user_defined = [AddedToken(token, special=False, normalized=False)
                    for token, kind in pairs if kind == TOKEN_TYPE_USER_DEFINED]
    if special:
        backend.add_special_tokens(special)
    if user_defined:
        backend.add_tokens(user_defined)


@functools.lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {char: byte for byte, char in _byte_to_unicode().items()}


def special_token_ids(backend: BackendTokenizer) -> dict[str, int]:
    """``{content: id}`` of the backend's special added tokens."""
    return {token.content: token_id for token_id, token in backend.get_added_tokens_decoder().items()
            if token.special}


# ---- HF directory helpers ----------------------------------------------------------------------

def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json writes a token as a string or as ``{"content": ...}``."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _declared_eos_ids(directory: Path) -> list[int]:
    """eos ids from generation_config.json, then config.json."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(directory / name).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    return ids


def _hf_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja if present, else tokenizer_config.json's (a string or named list)."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


# ---- chat template -------------------------------------------------------------------------------

def _flatten_message(message: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``message`` whose list-of-parts content is joined into one string."""
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise ValueError(f"unsupported message content part type {part.get('type')!r} (only 'text')")
        texts.append(part.get("text", ""))
    return {**message, "content": "".join(texts)}


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


@functools.lru_cache(maxsize=8)
def _compile_chat_template(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# ---- incremental detokenization ------------------------------------------------------------------

class TextStreamer:
    """Turns generated ids into text deltas that are final.

    A delta never ends in an incomplete UTF-8 character, never contains text that could still grow
    into a stop string, and ends right before the first stop string to complete (the longest one on
    a tie), which ``feed`` then reports. Invariant: the deltas plus ``flush()`` equal
    ``tokenizer.decode(ids)`` cut at that stop string, however the ids are chunked. Each ``feed``
    decodes only a small window of ids (prefix offset / read offset), so it costs O(new tokens).
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.skip_special_tokens = skip_special_tokens
        self.matched_stop: str | None = None
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: decoding from here gives stable text
        self._read_offset = 0  # ids before this are already turned into text
        self._num_unread_chars_taken = 0  # chars of the unread text already moved to _pending
        self._pending = ""  # decoded, not yet emitted (may begin a stop string)
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    @property
    def is_stopped(self) -> bool:
        return self.matched_stop is not None

    def feed(self, new_ids: list[int]) -> tuple[str, str | None]:
        """``(final text delta, matched stop string or None)``; after a stop, feeds are ignored."""
        if self.is_stopped:
            return "", None
        self._ids.extend(new_ids)
        self._pending += self._decode_new(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """Everything held back (incomplete characters, stop-string prefixes), at the end of generation."""
        if self.is_stopped:
            return ""
        self._pending += self._decode_new(final=True)
        delta, _ = self._release(final=True)
        return delta

    def _decode_new(self, final: bool) -> str:
        """Text of the unread ids that is final; a trailing U+FFFD run (maybe an incomplete
        character) waits for more ids unless ``final``."""
        text = self._unread_text()
        stable = text if final else text.rstrip(_REPLACEMENT_CHAR)
        delta = stable[self._num_unread_chars_taken:]
        if stable == text and text:  # clean boundary: the next window starts here
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._num_unread_chars_taken = 0
        else:
            self._num_unread_chars_taken += len(delta)
        return delta

    def _unread_text(self) -> str:
        """Decoded text of ids[read_offset:], decoded with a few read ids before it for context."""
        known = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        return text[len(known):] if len(text) > len(known) else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _release(self, final: bool) -> tuple[str, str | None]:
        """Emit pending text up to a stop string, or up to what might start one."""
        cut, matched = _first_stop(self._pending, self.stop)
        if matched is not None:
            self.matched_stop = matched
        elif not final:
            cut = len(self._pending) - _stop_prefix_len(self._pending, self.stop)
        delta, self._pending = self._pending[:cut], self._pending[cut:]
        if delta:
            self._emitted.append(delta)
        return delta, matched


def _first_stop(text: str, stop: list[str]) -> tuple[int, str | None]:
    """``(index, stop string)`` of the stop string that completes first in ``text`` (the longest on a
    tie), or ``(len(text), None)``. "First to complete" keeps the result independent of chunking."""
    best: tuple[int, int] | None = None
    matched = None
    for candidate in stop:
        index = text.find(candidate)
        if index == -1:
            continue
        key = (index + len(candidate), index)  # earliest end, then earliest start
        if best is None or key < best:
            best, matched = key, candidate
    return (best[1], matched) if best is not None else (len(text), None)


def _stop_prefix_len(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = min(len(text), max((len(s) - 1 for s in stop), default=0))
    for size in range(longest, 0, -1):
        suffix = text[-size:]
        if any(s.startswith(suffix) for s in stop):
            return size
    return 0
