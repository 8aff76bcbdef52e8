"""flashtree: lossless single-GPU LLM decoding with DFlash drafts and DDTree verification."""

__version__ = "0.1.0"
