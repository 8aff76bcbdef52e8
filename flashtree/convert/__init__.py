"""Model files: Hugging Face checkpoints to GGUF (hf.py), random-weight models of real shapes (synth.py,
shapes.py), descriptions of a GGUF (inspect.py)."""

# shapes.SHAPES' names, here for `flashtree synth --help` without importing torch (tests/test_cli.py checks)
SHAPE_NAMES = ("qwen3.6-27b", "qwen3-8b", "smollm2-135m", "tiny-llama", "tiny-qwen3", "tiny-qwen35")
