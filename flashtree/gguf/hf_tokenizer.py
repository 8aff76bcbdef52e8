"""Hugging Face `tokenizer.json` (+ `tokenizer_config.json`) -> GGUF tokenizer metadata.

Follows llama.cpp's converter (`get_vocab_base` + `SpecialVocab`): tokens in id order, holes padded
with `[PAD{id}]` of type UNUSED, added tokens typed CONTROL (special, or `<|...|>`-looking) or
USER_DEFINED, merges as "left right" strings, special ids looked up among the added tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flashtree.errors import FlashtreeError
from flashtree.gguf.tokenizer import CONTRACTIONS, CONTROL, NORMAL, PRE_TOKENIZERS, UNUSED, USER_DEFINED

# tokenizer.json writes the contractions case-insensitively where llama.cpp spells the cases out.
_HF_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# The Split regex of a tokenizer.json pre_tokenizer -> llama.cpp's name for it.
_SPLIT_REGEX_PRE = {
    PRE_TOKENIZERS[name].regexes[0].replace(CONTRACTIONS, _HF_CONTRACTIONS): name
    for name in ("qwen2", "qwen35", "llama-bpe")
}
# tokenizer_config's "<kind>_token" -> GGUF's tokenizer.ggml.<key>.
_GGUF_ID_KEY = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id"}


def gguf_tokenizer_metadata(
    tokenizer_json: Path,
    tokenizer_config: Path | None,
    vocab_size: int | None = None,
    pre: str | None = None,
    model_config: Path | None = None,
) -> dict[str, Any]:
    """The `tokenizer.*` GGUF keys for a byte-level BPE `tokenizer.json`.

    vocab_size: the model's embedding rows (the token list is padded to it); None = the highest id + 1.
    pre: the llama.cpp pre-tokenizer name; None = inferred from the tokenizer.json pre_tokenizer.
    model_config: the checkpoint's config.json, whose *_token_id fill ids the tokenizer files leave unset.
    """
    tok = _read_json(tokenizer_json)
    config = _read_json(tokenizer_config) if tokenizer_config is not None else {}
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not _is_byte_level(tok):
        raise FlashtreeError(f"{tokenizer_json}: only byte-level BPE tokenizers are supported")
    pre = pre or _infer_pre(tok, tokenizer_json)
    if pre not in PRE_TOKENIZERS:
        raise FlashtreeError(f"{tokenizer_json}: unknown pre-tokenizer {pre!r}")

    added = {int(a["id"]): a for a in tok.get("added_tokens", [])}
    by_id = {int(i): text for text, i in model["vocab"].items()} | {i: a["content"] for i, a in added.items()}
    n_tokens = vocab_size if vocab_size is not None else max(by_id) + 1
    if max(by_id) >= n_tokens:
        raise FlashtreeError(f"{tokenizer_json}: token id {max(by_id)} does not fit vocab_size {n_tokens}")
    tokens, types = [], []
    for i in range(n_tokens):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        types.append(_token_type(added.get(i), i in by_id))

    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [_merge_string(m) for m in model.get("merges", [])],
        "tokenizer.ggml.add_bos_token": _adds_bos(tok, config),
    }
    for kind, token_id in _special_ids(config, added, model_config).items():
        metadata[f"tokenizer.ggml.{_GGUF_ID_KEY[kind]}"] = token_id
    template = _chat_template(config, tokenizer_config)
    if template is not None:
        metadata["tokenizer.chat_template"] = template
    return metadata


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FlashtreeError(f"{path}: cannot read JSON ({e})") from e


def _pre_tokenizer_steps(tok: dict[str, Any]) -> list[dict[str, Any]]:
    pre = tok.get("pre_tokenizer") or {}
    return pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]


def _is_byte_level(tok: dict[str, Any]) -> bool:
    return any(step.get("type") == "ByteLevel" for step in _pre_tokenizer_steps(tok))


def _infer_pre(tok: dict[str, Any], path: Path) -> str:
    """Recognise the pre-tokenizers of the families we support from their tokenizer.json steps."""
    steps = _pre_tokenizer_steps(tok)
    kinds = [step.get("type") for step in steps]
    if kinds == ["Split", "ByteLevel"]:
        regex = steps[0].get("pattern", {}).get("Regex")
        if regex in _SPLIT_REGEX_PRE and not steps[1].get("use_regex", True):
            return _SPLIT_REGEX_PRE[regex]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if (
        kinds == ["Digits", "ByteLevel"]
        and steps[0].get("individual_digits")
        and steps[1].get("use_regex", True)
    ):
        return "smollm"
    raise FlashtreeError(
        f"{path}: cannot tell which pre-tokenizer this is; pass one of {sorted(PRE_TOKENIZERS)}"
    )


def _looks_special(text: str) -> bool:
    # llama.cpp's does_token_look_special: some models leave control tokens unmarked.
    return (text.startswith("<|") and text.endswith("|>")) or text in ("<pad>", "<mask>")


def _token_type(added_token: dict[str, Any] | None, known: bool) -> int:
    if not known:
        return UNUSED
    if added_token is None:
        return NORMAL
    if added_token.get("special") or _looks_special(added_token["content"]):
        return CONTROL
    return USER_DEFINED


def _merge_string(merge: str | list[str]) -> str:
    if isinstance(merge, str):
        return merge
    # Newer tokenizer.json files store pairs; a space inside a part is written as the byte-level space 'Ġ'.
    return " ".join(part.replace(" ", "\u0120") for part in merge)


def _adds_bos(tok: dict[str, Any], config: dict[str, Any]) -> bool:
    if isinstance(config.get("add_bos_token"), bool):
        return config["add_bos_token"]
    # Llama 3 style: a TemplateProcessing post-processor that starts every sequence with a special token.
    post = tok.get("post_processor") or {}
    for step in post.get("processors", [post]):
        if step.get("type") == "TemplateProcessing":
            single = step.get("single", [])
            return len(single) > 1 and "SpecialToken" in single[0]
    return False


def _special_ids(
    config: dict[str, Any], added: dict[int, dict[str, Any]], model_config: Path | None
) -> dict[str, int]:
    """bos/eos/pad ids: tokenizer_config names the tokens, config.json fills what is left."""
    id_of = {a["content"]: i for i, a in sorted(added.items(), reverse=True)}  # first id wins
    ids = {}
    for kind in _GGUF_ID_KEY:
        entry = config.get(f"{kind}_token")
        content = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(content, str) and content in id_of:
            ids[kind] = id_of[content]
    if model_config is not None:
        model = _read_json(model_config)
        for kind in _GGUF_ID_KEY:
            if kind not in ids and isinstance(model.get(f"{kind}_token_id"), int):
                ids[kind] = model[f"{kind}_token_id"]
    return ids


def _chat_template(config: dict[str, Any], tokenizer_config: Path | None) -> str | None:
    template = config.get("chat_template")
    if template is None and tokenizer_config is not None:
        # Newer checkpoints keep the template in its own file beside tokenizer_config.json.
        jinja = Path(tokenizer_config).with_name("chat_template.jinja")
        template = jinja.read_text(encoding="utf-8") if jinja.is_file() else None
    if isinstance(template, list):  # named templates: GGUF's tokenizer.chat_template is the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template
