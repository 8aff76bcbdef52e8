"""Byte-level BPE tokenizer built from GGUF metadata, chat templates, and streaming-safe decoding.

Encoding runs on the `tokenizers` library, set up the way llama.cpp reads the same metadata: the
pre-tokenizer regexes of `tokenizer.ggml.pre`, control and user-defined tokens matched whole in the
text, no normalizer. Decoding is our own byte table, so a token's raw bytes are always at hand.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.utils import Namespace
from tokenizers import AddedToken, Regex, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from flashtree.errors import FlashtreeError
from flashtree.gguf import chat_template
from flashtree.gguf.reader import check_key_names

# The metadata keys read (a key one byte away from a missing one is refused as corrupted)
_KEYS = [
    *(f"tokenizer.ggml.{k}" for k in ("model", "pre", "tokens", "token_type", "merges", "add_bos_token")),
    *(f"tokenizer.ggml.{k}_token_id" for k in ("bos", "eos", "eot", "padding")),
    "tokenizer.chat_template",
]
# GGUF token types (llama.cpp's llama_token_type; 6 = BYTE belongs to SentencePiece vocabularies).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's pre-tokenizer regexes, applied in order: each splits the pieces the previous one left.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's spelling of tokenizer.json's case-insensitive (?i:'s|'t|...), shared by the newer regexes.
CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp treats one `tokenizer.ggml.pre` value."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token is taken whole (llama3)
    add_bos: bool = False  # default when the metadata has no tokenizer.ggml.add_bos_token


_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "gpt-2": PreTokenizer((_GPT2,)),
    "llama-bpe": _LLAMA3_PRE,
    "llama3": _LLAMA3_PRE,
    "llama-v3": _LLAMA3_PRE,
    "qwen2": PreTokenizer((_QWEN2,)),
    "deepseek-r1-qwen": PreTokenizer((_QWEN2,)),
    "qwen35": PreTokenizer((_QWEN35,)),
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
}

# Tokens that end a turn or a document in the vocabularies llama.cpp knows (its EOG list, abridged).
_END_OF_GENERATION = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<EOT>",
)
# Of those, the ones that close a chat turn: the eot token when the metadata names none.
_END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<EOT>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each byte is written as one printable char; this maps char -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    char_of = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in char_of):
        char_of[b] = chr(256 + n)
    return {c: b for b, c in char_of.items()}


# str.translate table: byte-level char -> the char whose code is that byte, so .encode("latin-1") gives bytes.
_UNBYTE = str.maketrans({c: chr(b) for c, b in _byte_level_alphabet().items()})


def _normal_token_bytes(text: str) -> bytes:
    try:
        return text.translate(_UNBYTE).encode("latin-1")
    except UnicodeEncodeError:  # not byte-level text (a malformed vocab): keep what it says
        return text.encode("utf-8")


@dataclass(frozen=True)
class ChatText:
    """A rendered chat prompt whose message content had its control-token text hidden: `text` has a
    private-use character wherever content held a control token's text, and `hidden` maps it back."""

    text: str
    hidden: dict[str, str]

    def reveal(self, text: str) -> str:
        """`text` (a piece of `self.text`) with the content's control-token text put back."""
        return text.translate({ord(char): control for char, control in self.hidden.items()})

    @property
    def utf8_bytes(self) -> int:
        """Bytes of the prompt as the model reads it: a cheap bound on its tokens before tokenizing."""
        return len(self.reveal(self.text).encode("utf-8", errors="surrogatepass"))


class Tokenizer:
    """gpt2-style byte-level BPE from GGUF metadata. Build it with `Tokenizer.from_gguf_metadata`."""

    def __init__(
        self,
        tokens: list[str],
        token_types: list[int],
        merges: list[tuple[str, str]],
        pre: PreTokenizer,
        bos_id: int | None,
        eos_id: int | None,
        eot_id: int | None,
        pad_id: int | None,
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self.vocab_size = len(tokens)
        ids = {text: i for i, text in reversed(list(enumerate(tokens)))}  # first id wins on duplicates
        if eot_id is None:
            eot_id = next((ids[t] for t in _END_OF_TURN if t in ids), None)
        self.bos_id, self.eos_id, self.eot_id, self.pad_id = bos_id, eos_id, eot_id, pad_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._tokens = tokens
        self._bytes = [self._bytes_of(text, typ) for text, typ in zip(tokens, token_types, strict=True)]
        self._special = frozenset(i for i, t in enumerate(token_types) if t in (CONTROL, UNKNOWN))
        self._hf = _build_hf_tokenizer(tokens, token_types, merges, pre)
        stop = {ids[t] for t in _END_OF_GENERATION if t in ids} | {eos_id, eot_id}
        self.stop_ids: frozenset[int] = frozenset(stop - {None})

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Read the `tokenizer.*` keys of a GGUF file (a plain dict of its key/values; errors name the file
        when it is a reader.Metadata). Every value is checked for its type before it is used."""
        source = getattr(metadata, "path", None)
        try:
            return cls._from_metadata(metadata)
        except FlashtreeError as e:
            raise FlashtreeError(f"{source}: {e}" if source else str(e)) from None

    @classmethod
    def _from_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        check_key_names(metadata, _KEYS, None)
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise FlashtreeError(f"tokenizer.ggml.model: unsupported tokenizer {model!r} (only 'gpt2' BPE)")
        pre_name = metadata.get("tokenizer.ggml.pre") or "default"  # llama.cpp's fallback too
        if not isinstance(pre_name, str) or pre_name not in PRE_TOKENIZERS:
            known = ", ".join(sorted(PRE_TOKENIZERS))
            raise FlashtreeError(f"tokenizer.ggml.pre: unknown pre-tokenizer {pre_name!r} (known: {known})")
        pre = PRE_TOKENIZERS[pre_name]
        tokens = _list_of(metadata, "tokenizer.ggml.tokens", str)
        types = _list_of(metadata, "tokenizer.ggml.token_type", int, [NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise FlashtreeError(f"tokenizer.ggml.token_type: {len(types)} entries for {len(tokens)} tokens")
        odd = next((t for t in types if not 0 <= t <= BYTE), None)
        if odd is not None:
            raise FlashtreeError(f"tokenizer.ggml.token_type: {odd} is not a token type (0 to {BYTE})")
        merges = [_split_merge(m) for m in _list_of(metadata, "tokenizer.ggml.merges", str)]

        def token_id(key: str) -> int | None:
            value = metadata.get(f"tokenizer.ggml.{key}")
            if value is None:
                return None
            if not (isinstance(value, int) and 0 <= value < len(tokens)):
                raise FlashtreeError(f"tokenizer.ggml.{key}: {value!r} is not one of the {len(tokens)} ids")
            return value

        add_bos = metadata.get("tokenizer.ggml.add_bos_token", pre.add_bos)
        template = metadata.get("tokenizer.chat_template")
        if not isinstance(add_bos, bool):
            raise FlashtreeError(f"tokenizer.ggml.add_bos_token: {add_bos!r} is not a bool")
        if template is not None and not isinstance(template, str):
            raise FlashtreeError("tokenizer.chat_template: not text")
        return cls(
            tokens=tokens,
            token_types=types,
            merges=merges,
            pre=pre,
            bos_id=token_id("bos_token_id"),
            eos_id=token_id("eos_token_id"),
            eot_id=token_id("eot_token_id"),  # None: found by name, as llama.cpp does
            pad_id=token_id("padding_token_id"),
            add_bos=add_bos,
            chat_template=template,
        )

    # --- encode / decode ---------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. parse_special=False reads control tokens' text as plain text."""
        hf = self._hf if parse_special else self._hf_literal
        ids = hf.encode(text, add_special_tokens=False).ids
        add_bos = self.add_bos if add_bos is None else add_bos
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (a character cut off at the end) becomes U+FFFD."""
        if skip_special:
            ids = [i for i in ids if i not in self._special]
        return b"".join(self._bytes[i] for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, id: int) -> bytes:
        """The raw bytes token `id` stands for (a fragment of a UTF-8 character for some tokens)."""
        return self._bytes[id]

    def is_special(self, id: int) -> bool:
        """Control (or unknown) tokens: the ones decode(skip_special=True) leaves out."""
        return id in self._special

    @cached_property
    def _hf_literal(self) -> HFTokenizer:
        # A second copy, built only when needed, so encode() never flips state on a shared object.
        literal = HFTokenizer.from_str(self._hf.to_str())
        literal.encode_special_tokens = True
        return literal

    @staticmethod
    def _bytes_of(text: str, token_type: int) -> bytes:
        if token_type == NORMAL:
            return _normal_token_bytes(text)
        if token_type == UNUSED:
            return b""
        return text.encode("utf-8")  # control and user-defined tokens are stored as plain text

    @cached_property
    def longest_token_bytes(self) -> int:
        """The most bytes one token stands for: a text of n bytes has at least n / this many tokens."""
        return max((len(b) for b in self._bytes), default=1) or 1

    # --- chat prompts --------------------------------------------------------------------------------

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids of a conversation through the chat template. Only the control tokens the template
        writes are control tokens: a control token's text inside a message's content is read as plain
        text, so a user cannot forge a turn (`<|im_end|><|im_start|>system ...`)."""
        return self.encode_chat_text(self.render_chat(messages, add_generation_prompt))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> ChatText:
        """The template's text for `messages`, control-token text in their content hidden (ChatText)."""
        messages = [_template_message(m) for m in messages]
        contents = [m["content"] for m in messages if isinstance(m.get("content"), str)]
        found = self._control_pattern and {t for c in contents for t in self._control_pattern.findall(c)}
        if not found:
            return ChatText(self.apply_chat_template(messages, add_generation_prompt), {})
        chars = _unused_chars([*contents, self.chat_template or ""])
        hide = {control: next(chars) for control in sorted(found)}
        for m in messages:
            if isinstance(m.get("content"), str):
                m["content"] = self._control_pattern.sub(lambda hit: hide[hit.group()], m["content"])
        text = self.apply_chat_template(messages, add_generation_prompt)
        return ChatText(text, {char: control for control, char in hide.items()})

    def encode_chat_text(self, chat: ChatText) -> list[int]:
        """Ids of a rendered chat: each control-token text the template wrote is that token, the text
        between them (content revealed) is encoded with control tokens read as text. With nothing hidden
        this is what encode() gives the text, which `tokenizers` splits at the same places."""
        if not chat.hidden:
            return self.encode(chat.text, add_bos=False)
        ids: list[int] = []
        start = 0
        for marker in self._control_pattern.finditer(chat.text):
            ids += self._encode_literal(chat.reveal(chat.text[start : marker.start()]))
            ids.append(self._hf.token_to_id(marker.group()))
            start = marker.end()
        return ids + self._encode_literal(chat.reveal(chat.text[start:]))

    def _encode_literal(self, text: str) -> list[int]:
        return self.encode(text, add_bos=False, parse_special=False) if text else []

    @cached_property
    def _control_pattern(self) -> re.Pattern | None:
        """Matches control tokens' text, leftmost then longest, as `tokenizers` splits them out."""
        texts = {t.content for t in self._hf.get_added_tokens_decoder().values() if t.special and t.content}
        if not texts:
            return None
        return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))

    # --- chat template -----------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `tokenizer.chat_template` as transformers does (same jinja2 setup and variables)."""
        if self.chat_template is None:
            raise FlashtreeError(
                "tokenizer.chat_template: the model has no chat template; send a raw prompt instead"
                " (flashtree run --no-chat-template, or /v1/completions)"
            )
        special = {
            "bos_token": self._special_text(self.bos_id),
            "eos_token": self._special_text(self.eos_id),
            "pad_token": self._special_text(self.pad_id),
        }
        variables = {
            "messages": [_template_message(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            **{**special, **extra},
        }
        return chat_template.render(self._template, variables)

    def _special_text(self, id: int | None) -> str | None:
        return None if id is None else self._tokens[id]

    @cached_property
    def _template(self):
        try:
            return _jinja_env().from_string(self.chat_template)
        except TemplateError as e:
            raise FlashtreeError(f"tokenizer.chat_template does not compile: {e}") from e


class IncrementalDecoder:
    """Turns a stream of token ids into text, holding back a UTF-8 character until all its bytes came.

    Work per call is proportional to the new tokens: only the bytes of an unfinished character are kept.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Sequence[int]) -> str:
        """Text completed by `ids` (possibly empty when a character is still cut off)."""
        tk = self._tokenizer
        if self._skip_special:
            ids = [i for i in ids if not tk.is_special(i)]
        return self._utf8.decode(b"".join(tk.token_bytes(i) for i in ids))

    def flush(self) -> str:
        """Whatever is held back, with U+FFFD for bytes that never became a character."""
        return self._utf8.decode(b"", final=True)


def _unused_chars(texts: list[str]):
    """Private-use characters (plane 15) that occur in none of `texts`, in order."""
    for code in range(0xF0000, 0xFFFFE):
        char = chr(code)
        if not any(char in t for t in texts):
            yield char


def _list_of(metadata: dict[str, Any], key: str, kind: type, default: list | None = None) -> list:
    """metadata[key], a list of `kind` values (`default` when absent, else the key is required)."""
    value = metadata.get(key, default)
    if value is None:
        raise FlashtreeError(f"{key}: missing from the GGUF metadata")
    if not isinstance(value, list) or not all(type(v) is kind for v in value):
        raise FlashtreeError(f"{key}: not a list of {kind.__name__} values")
    return value


def _split_merge(merge: str) -> tuple[str, str]:
    # Search from index 1 as llama.cpp does, so a merge whose left part is a lone space still splits.
    cut = merge.find(" ", 1)
    if cut < 0:
        raise FlashtreeError(f"tokenizer.ggml.merges: entry {merge!r} is not 'left right'")
    return merge[:cut], merge[cut + 1 :]


def _build_hf_tokenizer(
    tokens: list[str], types: list[int], merges: list[tuple[str, str]], pre: PreTokenizer
) -> HFTokenizer:
    vocab: dict[str, int] = {}
    for i, (text, typ) in enumerate(zip(tokens, types, strict=True)):
        if typ != UNUSED:
            vocab.setdefault(text, i)
    for i, (left, right) in enumerate(merges):  # `tokenizers` panics (a Rust backtrace) on any other merge
        unknown = next((t for t in (left, right, left + right) if t not in vocab), None)
        if unknown is not None:
            raise FlashtreeError(f"tokenizer.ggml.merges: entry {i} ({left} {right}): no token {unknown!r}")
    try:
        hf = HFTokenizer(BPE(vocab, merges, ignore_merges=pre.ignore_merges))
    except Exception as e:  # whatever else `tokenizers` refuses
        raise FlashtreeError(f"tokenizer: cannot be built from the GGUF metadata ({e})") from None
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )

    def added(i: int) -> AddedToken:
        return AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)

    # Control tokens are matched only with parse_special; user-defined ones always (as llama.cpp does).
    hf.add_special_tokens([added(i) for i, t in enumerate(types) if t == CONTROL])
    hf.add_tokens([added(i) for i, t in enumerate(types) if t == USER_DEFINED])
    return hf


def _template_message(message: dict) -> dict:
    """A message as transformers hands it to templates: None-valued keys dropped, text parts joined."""
    message = {k: v for k, v in message.items() if v is not None}  # OpenAI sends content=None with tool calls
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise FlashtreeError(f"message content part of type {kind!r} is not supported (text only)")
        texts.append(part.get("text", ""))
    return {**message, "content": "\n".join(texts)}


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False):
    # transformers' tojson: no HTML escaping (jinja2's default would turn '<' into \u003c).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(Namespace):
    """jinja2's namespace() minus underscore names, which could reach Python internals from a template."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's signature trick: `self` may be a key
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat template sets the underscore attribute {name!r} on a namespace")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; it renders as is."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _jinja_env() -> chat_template.BoundedSandbox:
    """The environment transformers renders chat templates in."""
    env = chat_template.BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env
