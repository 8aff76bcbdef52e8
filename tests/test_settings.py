"""flashtree/settings.py: every FLASHTREE_* variable read in one place, checked, with a clear error."""

from pathlib import Path

import pytest

from flashtree.errors import FlashtreeError
from flashtree.kernels.tiles import DEFAULT_DENSE_TILES, DEFAULT_TILES, DenseTiles, KernelConfig, TileConfig
from flashtree.settings import VARIABLES, Settings, table


def test_no_variables_give_the_defaults():
    assert Settings.from_env({}) == Settings()
    assert Settings().kernels == KernelConfig() and Settings().kernels.tiles == DEFAULT_TILES


def test_every_variable_is_parsed_into_its_field(tmp_path):
    env = {
        "FLASHTREE_CACHE": str(tmp_path),
        "FLASHTREE_CUDA_GRAPHS": "0",
        "FLASHTREE_PDL": "0",
        "FLASHTREE_EXPANDABLE_SEGMENTS": "0",
        "FLASHTREE_QUANT_KERNELS": "1",
        "FLASHTREE_DRAFT_FP8": "matrices",
        "FLASHTREE_PREFILL_CHUNK": "512",
        "FLASHTREE_KERNELS": "torch",
        "FLASHTREE_QMM_KERNEL": "gluon",
        "FLASHTREE_QMM_ARITH": "bf16",
        "FLASHTREE_QMM_TILES": '{"m1": [128, 4, 1, 2], "b32:Q6_K": [64, 4, 1, 1, 0]}',
        "FLASHTREE_QMM_SPLITS": '{"int8:Q4_K:5120x6144": 32768}',
        "FLASHTREE_DENSE_KERNEL": "0",
        "FLASHTREE_DENSE_TILES": '{"default": [16, 32, 4, 1, 64, 0], "8x8": [32, 64, 4, 2, 9]}',
        "FLASHTREE_DELTA_TILE": "16,2",
        "FLASHTREE_GIT_COMMIT": "bd1996c",
    }
    assert set(env) == set(VARIABLES)  # the test covers every variable
    s = Settings.from_env(env)
    assert (s.cache, s.cuda_graphs, s.pdl, s.expandable_segments, s.quant_kernels, s.draft_fp8) == (
        tmp_path,
        False,
        False,
        False,
        True,
        "matrices",
    )
    k = s.kernels
    assert k.arithmetic == "bf16" and k.dense_kernel is False and k.delta_tile == (16, 2)
    assert k.tiles["m1"] == TileConfig(128, 4, 1, 2) and k.tiles["m16"] == DEFAULT_TILES["m16"]
    assert k.tiles["b32:Q6_K"] == TileConfig(64, 4, 1, 1, 0)
    assert dict(k.splits) == {"int8:Q4_K:5120x6144": 32768}
    assert k.dense_tiles["default"] == DenseTiles(16, 32, 4, 1, 64, 0) and k.dense_tiles["8x8"] == DenseTiles(
        32, 64, 4, 2, 9
    )
    assert k.dense_tiles["960x576"] == DEFAULT_DENSE_TILES["960x576"]
    assert s.git_commit == "bd1996c" and s.prefill_chunk == 512 and s.kernel_path == "torch"
    assert k.qmm_kernel == "gluon"
    assert "FLASHTREE_CACHE" not in s.explicit(env) and s.explicit(env)["FLASHTREE_PDL"] == "0"


def test_an_empty_cache_variable_is_the_default():
    assert Settings.from_env({"FLASHTREE_CACHE": ""}).cache == Path.home() / ".cache" / "flashtree"


@pytest.mark.parametrize(
    "name,value,message",
    [
        ("FLASHTREE_QMM_ARITH", "fp8", "FLASHTREE_QMM_ARITH='fp8': expected one of int8, bf16"),
        ("FLASHTREE_PDL", "yes", "FLASHTREE_PDL='yes': expected 0 or 1"),
        ("FLASHTREE_KERNELS", "cuda", "FLASHTREE_KERNELS='cuda': expected one of auto, triton, torch"),
        ("FLASHTREE_DRAFT_FP8", "1", "FLASHTREE_DRAFT_FP8='1': expected off, matrices or all"),
        ("FLASHTREE_PREFILL_CHUNK", "0", "FLASHTREE_PREFILL_CHUNK='0': expected a token count .1 to"),
        ("FLASHTREE_DELTA_TILE", "12,4", "FLASHTREE_DELTA_TILE='12,4'.*power of two"),
        ("FLASHTREE_DELTA_TILE", "16", "FLASHTREE_DELTA_TILE='16': expected BV,WARPS"),
        ("FLASHTREE_DELTA_TILE", "16,3", "FLASHTREE_DELTA_TILE"),
        ("FLASHTREE_QMM_TILES", '{"gemv": [8, 2, 2]}', "unknown keys"),
        ("FLASHTREE_QMM_TILES", '{"b32:Q9_K": [64, 4, 1]}', "unknown keys"),
        ("FLASHTREE_QMM_TILES", '{"b48:Q6_K": [64, 4, 1]}', "unknown keys"),
        ("FLASHTREE_QMM_TILES", "{", "FLASHTREE_QMM_TILES"),
        ("FLASHTREE_QMM_SPLITS", '{"int8:Q4_K:5120x6144": 0}', "FLASHTREE_QMM_SPLITS"),
        ("FLASHTREE_QMM_SPLITS", '{"fp8:Q4_K:5120x6144": 4096}', "FLASHTREE_QMM_SPLITS"),
        ("FLASHTREE_QMM_SPLITS", "[1, 2]", "FLASHTREE_QMM_SPLITS"),
        ("FLASHTREE_DENSE_TILES", "[1, 2]", "FLASHTREE_DENSE_TILES"),
        ("FLASHTREE_QMM_ARTIH", "bf16", "unknown setting FLASHTREE_QMM_ARTIH"),
    ],
)
def test_a_bad_value_or_name_is_one_clear_error(name, value, message):
    with pytest.raises(FlashtreeError, match=message):
        Settings.from_env({name: value})


def test_the_default_tile_keys_are_known_and_the_table_documents_every_variable():
    assert KernelConfig(tiles=DEFAULT_TILES).tiles == DEFAULT_TILES
    rows = table({"FLASHTREE_PDL": "0"})
    assert [row[0] for row in rows] == list(VARIABLES)
    assert all(default and doc for _, default, doc, _ in rows)
    assert dict((name, value) for name, _, _, value in rows)["FLASHTREE_PDL"] == "0"


def test_no_module_but_settings_reads_the_environment():
    import flashtree

    root = Path(flashtree.__file__).parent
    readers = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if ("os.environ" in path.read_text() or "getenv(" in path.read_text()) and path.name != "settings.py"
    ]
    assert readers == []


def test_cli_stops_on_a_bad_setting(monkeypatch):
    from typer.testing import CliRunner

    from flashtree.cli import app

    monkeypatch.setenv("FLASHTREE_PDL", "2")
    result = CliRunner().invoke(app, ["settings"])
    assert result.exit_code == 1 and "error: FLASHTREE_PDL='2': expected 0 or 1" in result.output


@pytest.mark.parametrize(
    "path,on_cpu,on_cuda", [("auto", False, True), ("triton", True, True), ("torch", False, False)]
)
def test_the_kernel_path_decides_which_tensors_run_the_triton_kernels(monkeypatch, path, on_cpu, on_cuda):
    from types import SimpleNamespace

    from flashtree import kernels

    monkeypatch.setenv("FLASHTREE_KERNELS", path)
    assert kernels.triton_kernels_for(SimpleNamespace(is_cuda=False)) is on_cpu
    assert kernels.triton_kernels_for(SimpleNamespace(is_cuda=True)) is on_cuda
    monkeypatch.setenv("FLASHTREE_KERNELS", "cuda")
    with pytest.raises(FlashtreeError, match="FLASHTREE_KERNELS='cuda'"):
        kernels.triton_kernels_for(SimpleNamespace(is_cuda=False))
