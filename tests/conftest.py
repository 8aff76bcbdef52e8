import pytest
import torch

# Tiny models: one thread avoids OpenMP spin/oversubscription costs that dwarf the work itself.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    """Directory for tiny converted models, shared by the whole test session."""
    return tmp_path_factory.mktemp("tiny-models")
