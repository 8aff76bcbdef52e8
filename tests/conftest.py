import pytest


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    """Directory for tiny converted models, shared by the whole test session."""
    return tmp_path_factory.mktemp("tiny-models")
