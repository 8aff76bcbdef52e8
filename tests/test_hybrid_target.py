"""benchmarks/hybrid_target.py end to end at a tiny scale on the CPU: a tiny random llama teacher writes
the data, a tiny Qwen3.5 model trains on it, converts to GGUF, and flashtree's output on the f32 file
equals transformers' on the trained checkpoint."""

import json

import pytest
import torch

from benchmarks import hybrid_target as H
from flashtree.gguf.reader import GGUFFile
from flashtree.models.config import FULL, LINEAR
from tests.tiny import tiny_gguf

TINY = [
    "--hidden", "64", "--layers", "4", "--ffn", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
    "--linear-k-heads", "1", "--linear-v-heads", "3", "--linear-head-dim", "16", "--context", "512",
]  # fmt: skip
PROMPTS = [f"Question {i}: what is {i} plus {i + 1}? Answer step by step." for i in range(8)]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_root):
    """The data and train stages on a tiny teacher: (output dir, common arguments, data arguments)."""
    out = tmp_path_factory.mktemp("hybrid")
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": p}) + "\n" for p in PROMPTS))
    common = ["--out", str(out), "--target", str(tiny_gguf("llama", 0, tiny_root)), "--device", "cpu"]
    data = ["--prompts", str(prompts), "--self-prompts", "none", "--gen-batch", "4",
            "--gen-max-new-tokens", "24"]  # fmt: skip
    H.main(["data", *common, *data])
    train = ["--tokens", "40000", "--batch", "4", "--lr", "1e-2", "--warmup-steps", "5",
             "--val-sequences", "2", "--log-every", "5", "--eval-every", "20"]  # fmt: skip
    H.main(["train", *common, *TINY, *train])
    return out, common, data


def test_config_is_the_hybrid_pattern(run):
    out, *_ = run
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["layer_types"] == [LINEAR, LINEAR, LINEAR, FULL]
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert config["tie_word_embeddings"]


def test_training_reduces_the_loss(run):
    out, *_ = run
    curve = json.loads((out / "loss_curve.json").read_text())
    assert curve[-1]["loss"] < 0.7 * curve[0]["loss"], curve
    assert "val_loss" in curve[-1]


def test_data_stage_resumes_at_the_missing_shard(run):
    out, common, data = run
    shards = sorted((out / "data").glob("shard-*.pt"))
    assert len(shards) == 2
    kept, redo = shards
    before = torch.load(redo, weights_only=True)
    stamp = kept.stat().st_mtime_ns
    redo.unlink()
    H.main(["data", *common, *data])
    after = torch.load(redo, weights_only=True)
    assert kept.stat().st_mtime_ns == stamp
    assert torch.equal(after["tokens"], before["tokens"])  # seeded per shard: the same responses
    assert json.loads((out / "data.json").read_text())["runs"][-1]["new_shards"] == 1


def test_converted_gguf_matches_transformers(run):
    out, common, _ = run
    H.main(["convert", *common, "--types", "f32", "q8_0", "--check-tokens", "16"])
    report = json.loads((out / "check.json").read_text())["files"]
    f32 = report["f32"]
    assert f32["tokenizer_keys_differing"] == []
    assert f32["identical"] == len(H.CHECK_PROMPTS)
    # fp32 both sides; the chunked (HF) and recurrent (flashtree decode) DeltaNet forms sum differently
    assert max(p["max_logit_diff"] for p in f32["prompts"]) < 2e-4
    assert report["q8_0"]["tokenizer_keys_differing"] == []
    with GGUFFile(out / "hybrid-f32.gguf") as g:
        assert g.arch == "qwen35"
