"""`flashtree serve` under hostile and heavy traffic (issue #41), on a tiny random model so that it runs
in about a minute on a CPU.

- A seeded fuzz of malformed requests (wrong types, nulls, huge numbers, NaN, negatives, unknown
  fields, broken JSON, wrong content types, malformed HTTP): no 5xx, no traceback in the server's log,
  and the server answers a good request exactly as before afterwards.
- A 20 MB body is refused with 413 within 100 ms (by its Content-Length, and counted when chunked),
  and the server's RSS grows by less than the 4 MiB limit; a prompt that cannot fit the context is
  refused before it is tokenized.
- A full queue answers 429 with Retry-After within 50 ms; a model that fails its warm-up forward makes
  /health and every completion answer 503 with the reason; /health is 503 until the warm-up has run.
- 8 concurrent clients, streaming or not, two of them disconnecting midway: every surviving answer is
  its solo answer, and the cancelled requests release the engine.

Timings are one measurement each, without retries, against the issue's targets: 429 < 50 ms and a 413
by Content-Length < 100 ms (measured 1-10 ms on a 2-core machine at load 8); a chunked 20 MB body, of
which the server must read the 4 MiB limit before it can know, < 100 ms + 150 ms (measured 8-60 ms).
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from flashtree.engine.generate import Engine
from flashtree.serve.api import OpenAIServer, _listen_socket
from tests.test_server import metrics, server_process
from tests.tiny import tiny_gguf

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "llama-0-320"  # the tiny GGUF's stem
LIMIT = 4 << 20  # the default --max-request-bytes
FUZZ_CASES = 300
FUZZ_SEED = 41
CHUNKED_MARGIN_S = 0.15


@pytest.fixture(scope="module")
def tiny_target(tiny_root):
    return tiny_gguf("llama", 0, tiny_root)


@pytest.fixture(scope="module")
def tiny_server(tiny_target, tmp_path_factory):
    """A subprocess server on the tiny model with the default limits and a short context."""
    log = tmp_path_factory.mktemp("serve-fuzz") / "serve.log"
    options = ("--target", str(tiny_target), "--draft", "none", "--api-key", KEY)
    with server_process(log, *options, max_ctx=48) as (url, proc):
        yield url, proc, log


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server[0], headers=AUTH, timeout=120) as client:
        yield client


# --- the fuzz ---------------------------------------------------------------------------------------

HOSTILE_VALUES = [
    None, True, False, 0, -1, 1, 2**31, 2**64, -(2**63) - 1, 10**40, 1e308, -1e308, 0.5, -0.0, "", "x",
    "\x00", "NaN", "1", "é" * 300, [], [None], [1, "a"], {}, {"a": {"b": []}}, [[[[[]]]]],
]  # fmt: skip
RAW_TOKENS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" * 5000, '"\\ud800"', "[" * 5000]
FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "stream", "stream_options", "n", "logprobs", "user", "tools", "frequency_penalty",
    "response_format", "zzz_unknown", "",
]  # fmt: skip
CONTENT_TYPES = [
    "application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/json; charset=latin-1", "",
]  # fmt: skip


def _base(rng: random.Random, path: str) -> dict:
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = rng.choice(["Hi", [5, 6, 7]])
    return body


def _mutate_message(rng: random.Random, body: dict) -> None:
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages and isinstance(messages[0], dict)):
        messages = body["messages"] = [{"role": "user", "content": "Hi"}]
    key = rng.choice(["role", "content", "name", "tool_calls", "extra"])
    messages[0][key] = rng.choice(
        HOSTILE_VALUES + ["tool", "system", "developer", [{"type": "text", "text": 5}], [{"type": "image"}]]
    )


def _fuzz_body(rng: random.Random, path: str) -> bytes:
    """One malformed (or, now and then, odd but valid) request body."""
    body = _base(rng, path)
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.55:
            body[rng.choice(FIELDS)] = rng.choice(HOSTILE_VALUES)
        elif roll < 0.75:
            _mutate_message(rng, body)
        else:
            body.pop(rng.choice(list(body) or ["model"]), None)
    text = json.dumps(body)
    roll = rng.random()
    if roll < 0.15:  # a raw JSON token json.dumps would never write, in place of a value
        key = rng.choice(["temperature", "max_tokens", "top_p", "seed", "model"])
        text = json.dumps({**body, key: "@@"}).replace('"@@"', rng.choice(RAW_TOKENS))
    elif roll < 0.3:  # broken JSON: truncated, or a byte flipped
        cut = rng.randrange(len(text))
        flipped = text[:cut] + chr(rng.randrange(32, 127)) + text[cut + 1 :]
        text = text[:cut] if rng.random() < 0.5 else flipped
    data = text.encode()
    if rng.random() < 0.05:
        data = rng.choice([b"\xff\xfe\x00garbage", b"", b"null", b"[]", b'"str"', b"{" * 20000])
    return data


def _raw_http(url: str, request: bytes, timeout_s: float = 2) -> bytes:
    """The head of what the server answers to bytes sent as they are ("" if it just closes)."""
    host, port = url.removeprefix("http://").split(":")
    answer = b""
    # the server may close before it has read everything: OSError ends the reading
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock, contextlib.suppress(OSError):
        sock.sendall(request)
        while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    return answer


MALFORMED_HTTP = [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{}",  # body cut short
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
    + KEY.encode()
    + b"\r\nContent-Length: 100\r\n\r\n{}",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
    b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(5000)) + b"\r\n",
    b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(64)),  # a TLS ClientHello
]


def test_fuzzed_requests_never_get_a_5xx(tiny_server, http):
    url, _, log = tiny_server
    good = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    before = http.post("/v1/completions", json=good).json()["choices"][0]["text"]
    rng = random.Random(FUZZ_SEED)
    statuses: dict[int, int] = {}
    for i in range(FUZZ_CASES):
        path = rng.choice(["/v1/chat/completions", "/v1/completions"])
        body = _fuzz_body(rng, path)
        headers = {**AUTH, "Content-Type": rng.choice(CONTENT_TYPES)}
        r = http.post(path, content=body, headers=headers)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, f"case {i}: {body[:300]!r} -> {r.status_code} {r.text[:300]}"
        if r.status_code >= 400:
            error = r.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", (i, r.text)
    for request in MALFORMED_HTTP:
        answer = _raw_http(url, request)
        assert not answer.startswith(b"HTTP/1.1 5"), (request[:80], answer[:200])
    assert statuses.get(200, 0) > 0 and sum(n for s, n in statuses.items() if s >= 400) > FUZZ_CASES // 2
    assert http.post("/v1/completions", json=good).json()["choices"][0]["text"] == before
    assert _tracebacks(log.read_text()) == []


def _tracebacks(log: str) -> list[str]:
    """The exception lines of the tracebacks in a server log, but for uvicorn's own race on a malformed
    chunked body (it answers 400 itself; the app's answer then meets h11's closed connection state)."""
    ends = []
    for block in log.split("Traceback (most recent call last):")[1:]:
        ends.append(next((line for line in block.splitlines()[1:] if line[:1] not in " \t"), "?"))
    return [end for end in ends if not end.startswith("h11._util.LocalProtocolError")]


# --- size limits --------------------------------------------------------------------------------------


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmRSS:"))
    return int(kib) * 1024


def _post_huge(url: str, chunked: bool, total: int = 20 << 20) -> tuple[bytes, float]:
    """POST a `total`-byte body the way an attacker would: headers, then the body as fast as the socket
    takes it, while reading the answer. Returns (answer head, seconds from the first byte sent)."""
    host, port = url.removeprefix("http://").split(":")
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % total
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Authorization: Bearer " + KEY.encode() + b"\r\n" + framing + b"\r\n\r\n"
    piece = b"a" * (64 << 10)
    if chunked:
        piece = b"%x\r\n" % len(piece) + piece + b"\r\n"

    def send_body(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):  # the server closes the connection once it has answered
            for _ in range(total // (64 << 10)):
                sock.sendall(piece)

    with socket.create_connection((host, int(port)), timeout=30) as sock:
        start = time.perf_counter()
        sock.sendall(head)
        sender = threading.Thread(target=send_body, args=(sock,))
        sender.start()
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        elapsed = time.perf_counter() - start
        with contextlib.suppress(OSError):  # the server may have closed the connection already
            sock.shutdown(socket.SHUT_RDWR)
        sender.join()
    return answer, elapsed


def test_huge_body_is_refused_at_once(tiny_server, http):
    url, proc, _ = tiny_server
    # The code paths have run once before RSS is measured: a chunked request, a 413.
    http.post("/v1/completions", content=iter([b'{"model": "x"', b"}"]))
    assert _post_huge(url, chunked=False, total=LIMIT + 1)[0].startswith(b"HTTP/1.1 413")
    rss_before = _rss_bytes(proc.pid)
    answer, by_length_s = _post_huge(url, chunked=False)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    by_length_growth = _rss_bytes(proc.pid) - rss_before
    answer, chunked_s = _post_huge(url, chunked=True)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    growth = _rss_bytes(proc.pid) - rss_before
    print(
        f"20 MB: 413 by Content-Length in {by_length_s * 1e3:.1f} ms (RSS +{by_length_growth / 2**20:.2f} "
        f"MiB), chunked in {chunked_s * 1e3:.1f} ms (RSS +{growth / 2**20:.2f} MiB in all)"
    )
    # By its Content-Length: the target itself. Chunked: the server has to read the limit's 4 MiB before
    # it knows, so the target plus a margin.
    assert by_length_s < 0.1 and chunked_s < 0.1 + CHUNKED_MARGIN_S
    # By its Content-Length nothing of the body is kept. A chunked body is held up to the limit before it
    # is refused, and the allocator may keep those pages for the next one: the limit, plus 2 MiB for
    # uvicorn's and h11's buffers (+4.5 to +4.9 MiB measured in all, often less).
    assert by_length_growth < 1 << 20 and growth < LIMIT + (2 << 20)
    r = http.post("/v1/completions", content=b"x" * (LIMIT + 1))  # a client that sends it all first
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert http.get("/health").json()["status"] == "ok"


def test_prompt_too_long_is_refused_before_tokenizing(http):
    # 3 MB fit the body limit; the context has 48 tokens. Only the byte bound (checked before the
    # prompt is tokenized) says "at least": the token count after tokenizing is exact.
    huge = "word " * (600 << 10)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": huge}]}
    for path, body, param in [
        ("/v1/completions", {"model": MODEL, "prompt": huge}, "prompt"),
        ("/v1/chat/completions", chat, "messages"),
    ]:
        r = http.post(path, json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and (error["code"], error["param"]) == ("context_length_exceeded", param)
        assert "at least" in error["message"], error["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi " * 60})  # caught once tokenized
    assert r.json()["error"]["code"] == "context_length_exceeded" and "at least" not in r.text


# --- queue, warm-up: an in-process server whose engine the test controls ----------------------------


@contextlib.contextmanager
def in_process(server: OpenAIServer, ready: bool = True):
    """Serve `server.app` with uvicorn on a thread of this process; yields the base URL."""
    sock = _listen_socket("127.0.0.1", 0)  # as `flashtree serve` binds it
    uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + 60
        while not uv.started or (ready and httpx.get(url + "/health").status_code != 200):
            assert time.monotonic() < deadline, "the in-process server did not start"
            time.sleep(0.05)
        yield url
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture
def tiny_engine(tiny_target):
    return Engine.load(tiny_target, draft="none", max_ctx=64, device="cpu")


class Gate:
    """Holds every generation of an engine at its start until opened; counts the ones that entered."""

    def __init__(self, engine: Engine):
        self.open, self.entered = threading.Event(), threading.Semaphore(0)
        stream = engine.stream

        def gated(*args, **kwargs):
            self.entered.release()
            assert self.open.wait(60)
            yield from stream(*args, **kwargs)

        engine.stream = gated


def test_full_queue_answers_429_at_once(tiny_engine):
    gate = Gate(tiny_engine)
    server = OpenAIServer(tiny_engine, MODEL, max_queue=2)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    with in_process(server) as url, ThreadPoolExecutor(3) as pool:
        held = [pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60) for _ in range(3)]
        assert gate.entered.acquire(timeout=30)  # one runs (held at the gate), two wait
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health").json()["queued"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with httpx.Client(base_url=url) as client:  # connected before the clock starts
            client.get("/health")
            start = time.perf_counter()
            r = client.post("/v1/completions", json=body)
            elapsed = time.perf_counter() - start
        print(f"429 in {elapsed * 1e3:.1f} ms")
        gate.open.set()
        answers = [f.result() for f in held]
    assert r.status_code == 429 and elapsed < 0.05
    assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert [a.status_code for a in answers] == [200] * 3
    assert len({a.json()["choices"][0]["text"] for a in answers}) == 1


def test_failed_warm_up_is_reported(tiny_engine):
    def broken(*args, **kwargs):
        raise RuntimeError("the weights are garbage")

    tiny_engine.target.forward = broken
    with in_process(OpenAIServer(tiny_engine, MODEL), ready=False) as url:
        deadline = time.monotonic() + 30
        while (health := httpx.get(url + "/health")).json()["status"] == "warming":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "the weights are garbage" in health.json()["error"]
        for path, body in [
            ("/v1/completions", {"model": MODEL, "prompt": "Hi"}),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
        ]:
            r = httpx.post(url + path, json=body)
            assert r.status_code == 503 and "the weights are garbage" in r.json()["error"]["message"]
            assert r.json()["error"]["type"] == "server_error"
        assert httpx.get(url + "/v1/models").status_code == 200


def test_not_ready_until_warmed_up(tiny_engine):
    gate = Gate(tiny_engine)
    generate = tiny_engine.generate
    warming = threading.Event()

    def held_warm_up(*args, **kwargs):  # the first generate() is the warm-up's
        tiny_engine.generate = generate
        warming.set()
        assert gate.open.wait(60)
        return generate(*args, **kwargs)

    tiny_engine.generate = held_warm_up
    with in_process(OpenAIServer(tiny_engine, MODEL), ready=False) as url, ThreadPoolExecutor(1) as pool:
        assert warming.wait(30)
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "warming"
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
        waiting = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60)
        time.sleep(0.2)
        assert not waiting.done()  # a request during the warm-up waits for it
        gate.open.set()
        assert waiting.result().status_code == 200
        assert httpx.get(url + "/health").status_code == 200


# --- concurrency ----------------------------------------------------------------------------------


def _ask(url: str, request: dict) -> dict:
    """Send one client's request; returns its text and finish reason, or how far it got before it left
    (request["leave_after"] chunks of a stream, or request["timeout"] seconds of a whole reply)."""
    path, body = request["path"], request["body"]
    key = "content" if path.endswith("chat/completions") else "text"
    timeout = httpx.Timeout(120, read=request.get("read_timeout", 120))
    with httpx.Client(base_url=url, headers=AUTH, timeout=timeout) as client:
        if not body.get("stream"):
            try:
                choice = client.post(path, json=body).json()["choices"][0]
            except httpx.ReadTimeout:
                return {"left": True}
            return {"text": choice.get("message", choice).get(key), "finish": choice["finish_reason"]}
        text, finish, seen = "", None, 0
        with client.stream("POST", path, json=body) as response:
            for line in response.iter_lines():  # read as it comes: a leaver must not read it all
                event = line.removeprefix("data: ")
                if not line.startswith("data: "):
                    continue
                if event == "[DONE]":
                    break
                choices = json.loads(event)["choices"]
                if choices:
                    text += choices[0].get("delta", choices[0]).get(key) or ""
                    finish = choices[0]["finish_reason"] or finish
                seen += 1
                if seen == request.get("leave_after"):
                    return {"left": finish is None}
    return {"text": text, "finish": finish}


def _clients() -> list[dict]:
    prompts = ["Hello", "def add(a, b):", "The quick brown fox", "Question: 7 * 6?", "12345", "lazy dog"]
    clients = []
    for i, prompt in enumerate(prompts):
        sampling = {"temperature": 0} if i % 3 else {"temperature": 0.8, "seed": i}
        body = {"model": MODEL, "max_tokens": 12, "stream": i % 2 == 0, **sampling}
        if i < 3:
            clients.append({"path": "/v1/chat/completions", "body": {**body, "messages": [{"role": "user",
                            "content": prompt}]}})  # fmt: skip
        else:
            clients.append({"path": "/v1/completions", "body": {**body, "prompt": prompt}})
    # Leavers ask for the whole context (~1000 tokens) and go: one after the first streamed chunk, one
    # (a whole reply) 50 ms after sending, most likely while its request still waits in the queue.
    long = {"model": MODEL, "prompt": "Speculative decoding", "temperature": 0}
    clients.append({"path": "/v1/completions", "body": {**long, "stream": True}, "leave_after": 1})
    clients.append({"path": "/v1/completions", "body": long, "read_timeout": 0.05})
    return clients


def _settled(http: httpx.Client, before: dict, outcomes: int) -> dict:
    """The metrics once `outcomes` more requests have ended (a leaver's end may trail its client)."""
    deadline = time.monotonic() + 60
    while True:
        now = metrics(http)
        ended = sum(v - before.get(k, 0) for k, v in now.items() if k.startswith("flashtree_requests_total"))
        if ended >= outcomes or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def test_concurrent_clients_some_leaving(tiny_target, tmp_path):
    clients = _clients()
    options = ("--target", str(tiny_target), "--draft", "none", "--api-key", KEY)
    with server_process(tmp_path / "serve.log", *options, max_ctx=1024) as (url, _):
        solo = [_ask(url, c) for c in clients[:6]]
        assert all(s["finish"] in ("length", "stop") for s in solo)
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as plain:
            before = metrics(plain)
            with ThreadPoolExecutor(len(clients)) as pool:
                together = list(pool.map(lambda c: _ask(url, c), clients))
            start = time.monotonic()
            later = plain.post(clients[3]["path"], json=clients[3]["body"]).json()
            waited = time.monotonic() - start
            after = _settled(plain, before, len(clients) + 1)
    assert together[:6] == solo
    assert together[6:] == [{"left": True}] * 2  # both left before their reply ended
    assert later["choices"][0]["text"] == solo[3]["text"]
    assert waited < 30, f"the request after the disconnects waited {waited:.1f} s"
    cancelled = 'flashtree_requests_total{outcome="cancelled"}'
    assert after.get(cancelled, 0) - before.get(cancelled, 0) == 2
    generated = after["flashtree_generated_tokens_total"] - before["flashtree_generated_tokens_total"]
    abandoned = generated - 6 * 12 - later["usage"]["completion_tokens"]  # survivors: at most 12 each
    print(
        f"the 2 leavers' jobs generated at most {abandoned:.0f} tokens; the next request took {waited:.2f} s"
    )
    assert abandoned < 2 * 500, f"the leavers' jobs went on for {abandoned} tokens (~2000 asked)"
