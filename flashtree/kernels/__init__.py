"""Triton kernels (quantized matmul, tree DeltaNet, tree conv, rotary), each next to the torch path it
replaces on the GPU."""


def triton_kernels_for(x) -> bool:
    """Whether the model's decode/verify paths run our Triton kernels (on CUDA) or the torch reference.
    Tests set it to always, to run the kernels inside a model under TRITON_INTERPRET=1."""
    return x.is_cuda
