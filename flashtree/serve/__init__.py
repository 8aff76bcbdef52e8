"""The OpenAI-compatible server (api.py) and the terminal chat (chat.py). The server's limits' defaults
live here, where `flashtree serve --help` reads them without importing the server."""

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: a full 128k-token prompt is ~0.5 MB of text
DEFAULT_MAX_QUEUE = 32  # requests waiting for the engine (or being tokenized) beyond the running one
