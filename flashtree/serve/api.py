"""`flashtree serve`: an OpenAI-compatible HTTP API (FastAPI + uvicorn) over one engine.

Routes: GET /health, GET /metrics, GET /v1/models[/{id}], POST /v1/chat/completions, POST /v1/completions.
Every error is OpenAI's body `{"error": {"message", "type", "param", "code"}}`. Each completion also
carries the engine's speculative-decoding stats under the extra field "flashtree". Its
"system_fingerprint" names the decoding mode, and an engine whose output is not the full model's says so
there, in the stats' "lossy", in /health and in an `X-Flashtree-Lossy` header (e.g. "attn-window 4096").

Hostile input is refused before it costs much: a body over --max-request-bytes (413, before it is read),
a prompt that cannot fit the context (400, by its byte length before it is tokenized), more than
--max-queue requests waiting (429 with Retry-After), and with --api-key every path but /health needs
`Authorization: Bearer KEY`. /health answers 503 until a warm-up generation has run, and for good (with
the reason, as every completion then is) if it failed.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from flashtree.config import EngineConfig, SamplingParams
from flashtree.defaults import DEFAULT_TARGET_NAME
from flashtree.engine.generate import Chunk, Engine
from flashtree.errors import FlashtreeError
from flashtree.serve import DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES
from flashtree.serve.guard import APIError, Guard, check_api_key
from flashtree.serve.schemas import ChatCompletionRequest, CompletionRequest
from flashtree.serve.worker import FAILED, READY, EngineUnavailable, EngineWorker, Job, Metrics

DISCONNECT_POLL_S = 0.1
MAX_RETRY_AFTER_S = 60


def _param(loc: tuple) -> str | None:
    """A pydantic error location as OpenAI names a parameter: messages[0].content."""
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else f".{part}"
    return param.lstrip(".") or None


def _validation_error(e: ValidationError) -> APIError:
    first = e.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"We could not parse the JSON body of your request: {first['msg']}")
    param = _param(first["loc"])
    if first["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param)
    message = first["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}" if param else message, param)


class _ChatShape:
    """How a reply looks on /v1/chat/completions."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"
    text_key = "content"
    opening = {"role": "assistant", "content": ""}  # the first streamed delta, as OpenAI sends it

    @staticmethod
    def choice(text: str, finish_reason: str | None) -> dict:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}

    @staticmethod
    def delta(delta: dict, finish_reason: str | None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


class _TextShape:
    """How a reply looks on /v1/completions: the same choice object whole or streamed."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"
    text_key = "text"
    opening = None

    @staticmethod
    def choice(text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    @staticmethod
    def delta(delta: dict, finish_reason: str | None) -> dict:
        return _TextShape.choice(delta.get("text", ""), finish_reason)


class OpenAIServer:
    """The FastAPI app around one engine, its worker thread and its metrics. `app` is the ASGI app to
    serve: FastAPI's behind the Guard (API key, request size)."""

    def __init__(
        self,
        engine: Engine,
        model_id: str,
        api_key: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_queue: int = DEFAULT_MAX_QUEUE,
    ):
        check_api_key(api_key)
        self.engine, self.model_id, self.api_key = engine, model_id, api_key
        self.max_request_bytes, self.max_queue = max_request_bytes, max_queue
        self.started = int(time.time())
        self.metrics = Metrics()
        self.worker = EngineWorker(engine, self.metrics)
        self._preparing = 0  # admitted requests not yet queued (being parsed or tokenized)
        self._longest_token = engine.tokenizer.longest_token_bytes if engine.tokenizer else 1
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI):
            self.worker.start()
            yield
            self.worker.stop()

        app = FastAPI(title="flashtree", lifespan=lifespan, docs_url=None, redoc_url=None)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.prometheus, methods=["GET"])
        app.add_api_route("/v1/models", self.list_models, methods=["GET"])
        app.add_api_route("/v1/models/{model:path}", self.get_model, methods=["GET"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_exception_handler(APIError, self._on_api_error)
        app.add_exception_handler(HTTPException, self._on_http_error)
        app.add_exception_handler(Exception, self._on_unexpected_error)
        app.add_middleware(
            Guard, api_key=self.api_key, max_request_bytes=self.max_request_bytes, on_reject=self._count
        )
        return app

    # --- errors ---

    def _count(self, path: str, status: int) -> None:
        """A completion request answered with an error: rejected (4xx) or failed (5xx)."""
        if path.endswith("completions"):
            self.metrics.record_outcome(
                "failed" if status >= 500 else "cancelled" if status == 499 else "rejected"
            )

    async def _on_api_error(self, request: Request, e: APIError) -> JSONResponse:
        self._count(request.url.path, e.status)
        return e.response()

    async def _on_http_error(self, request: Request, e: HTTPException) -> JSONResponse:
        """Starlette's own errors (unknown route, wrong method) in OpenAI's shape."""
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").response()

    async def _on_unexpected_error(self, request: Request, e: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(e).__name__}: {e}").response()

    # --- informational routes ---

    async def health(self) -> JSONResponse:
        """200 once the warm-up generation has run; 503 before (status "warming") and after a failed one
        (status "failed", with the error)."""
        worker = self.worker
        body = {"status": "ok" if worker.state == READY else worker.state, "model": self.model_id}
        body |= {"mode": self.engine.mode, "lossy": self.engine.lossy, "queued": worker.queued}
        if worker.state == FAILED:
            body["error"] = worker.failure
        return JSONResponse(body, status_code=200 if worker.state == READY else 503)

    async def prometheus(self) -> PlainTextResponse:
        return PlainTextResponse(
            self.metrics.render(self.worker.queued), media_type="text/plain; version=0.0.4"
        )

    def _model_card(self) -> dict:
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.started,
            "owned_by": "flashtree",
            "max_model_len": self.engine.max_ctx,
        }

    async def list_models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    async def get_model(self, model: str) -> dict:
        self._check_model(model)
        return self._model_card()

    def _check_model(self, model: str) -> None:
        if model != self.model_id:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_id}`.",
                "model",
                "model_not_found",
            )

    # --- completions ---

    async def chat_completions(self, request: Request):
        req = await self._parse(request, ChatCompletionRequest)
        with self._admitted():
            messages = [m.for_template() for m in req.messages]
            prompt_ids = await self._tokenize("messages", self._encode_chat, messages)
            job = self._submit(req, prompt_ids, "messages")
        return await self._respond(request, req, job, "messages", _ChatShape)

    async def completions(self, request: Request):
        req = await self._parse(request, CompletionRequest)
        with self._admitted():
            prompt_ids = req.prompt
            if isinstance(prompt_ids, str):
                self._check_fits(len(prompt_ids.encode("utf-8", errors="surrogatepass")), "prompt")
                prompt_ids = await self._tokenize("prompt", self.engine.encode, req.prompt, chat=False)
            job = self._submit(req, prompt_ids, "prompt")
        return await self._respond(request, req, job, "prompt", _TextShape)

    async def _parse(self, request: Request, schema):
        """The validated body; 400 for bad JSON, wrong types, unknown or unsupported fields; 404 for a model
        other than ours."""
        try:
            body = await request.body()
        except ClientDisconnect:  # gone before the body was complete: nobody to answer
            raise APIError(499, "the client closed the connection before the request was complete") from None
        try:
            req = schema.model_validate_json(body)
        except ValidationError as e:
            raise _validation_error(e) from None
        self._check_model(req.model)
        unsupported = req.unsupported_field()
        if unsupported:
            raise APIError(400, unsupported[1], unsupported[0])
        return req

    @contextmanager
    def _admitted(self):
        """Room for one more request: 503 after a failed warm-up; 429 (with Retry-After) when --max-queue
        requests already wait for the engine or are being tokenized. Everything here runs on the event
        loop, so the count cannot race."""
        if self.worker.failure is not None:
            raise APIError(503, self.worker.failure, code="engine_unavailable")
        waiting = self.worker.queued + self._preparing
        if waiting >= self.max_queue:
            retry_s = min(max(math.ceil(self.worker.job_s * (waiting + 1)), 1), MAX_RETRY_AFTER_S)
            raise APIError(
                429,
                f"The server is busy: {waiting} requests are waiting for the engine (--max-queue "
                f"{self.max_queue}); retry after {retry_s} s.",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(retry_s)},
            )
        self._preparing += 1
        try:
            yield
        finally:
            self._preparing -= 1

    def _check_fits(self, n_bytes: int, param: str) -> None:
        """Before tokenizing: a text of n bytes has at least n / (the longest token's bytes) tokens."""
        at_least = -(-n_bytes // self._longest_token)
        if at_least >= self.engine.max_ctx:
            raise self._too_long(f"at least {at_least} ({n_bytes} bytes)", param)

    def _too_long(self, n_tokens: str, param: str) -> APIError:
        return APIError(
            400,
            f"This model's maximum context length is {self.engine.max_ctx} tokens; "
            f"the prompt has {n_tokens}.",
            param,
            "context_length_exceeded",
        )

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        """Engine.encode_messages, with the length bound checked between rendering and tokenizing."""
        tokenizer = self.engine.tokenizer
        chat = tokenizer.render_chat(messages, add_generation_prompt=True)
        self._check_fits(chat.utf8_bytes, "messages")
        return tokenizer.encode_chat_text(chat)

    @staticmethod
    async def _tokenize(param: str, fn, *args, **kwargs) -> list[int]:
        # Off the event loop: a long prompt takes a while to render and tokenize.
        try:
            return await run_in_threadpool(fn, *args, **kwargs)
        except FlashtreeError as e:
            raise APIError(400, str(e), param) from None

    def _submit(self, req, prompt_ids: list[int], param: str) -> Job:
        if len(prompt_ids) >= self.engine.max_ctx:
            raise self._too_long(str(len(prompt_ids)), param)
        try:
            sampling = SamplingParams(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=max(req.top_k, 0),
                seed=secrets.randbits(32) if req.seed is None else req.seed,
            )
            # Without a limit the reply may run to the end of the context (the engine clips to what fits).
            return self.worker.submit(prompt_ids, req.token_limit or self.engine.max_ctx, sampling, req.stop)
        except FlashtreeError as e:
            raise APIError(400, str(e)) from None
        except EngineUnavailable as e:
            raise APIError(503, str(e), code="engine_unavailable") from None

    async def _respond(self, request: Request, req, job: Job, param: str, shape):
        chunks = self._watched(request, job)
        try:
            # Wait for the first chunk so that a rejected generation still gets an error status.
            first = await anext(chunks)
        except FlashtreeError as e:
            raise APIError(400, str(e), param) from None
        except EngineUnavailable as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        except StopAsyncIteration:  # cancelled before it started: the client is gone
            return PlainTextResponse("", status_code=499)
        lossy = self.engine.lossy
        fingerprint = f"flashtree-{self.engine.mode}" + (f" lossy: {lossy}" if lossy else "")
        reply = _Reply(shape, self.model_id, job, fingerprint)
        labels = {"X-Flashtree-Lossy": lossy} if lossy else {}
        if req.stream:
            events = reply.sse(first, chunks, req.include_usage)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **labels}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(await reply.whole(first, chunks), headers=labels)

    @staticmethod
    async def _watched(request: Request, job: Job) -> AsyncIterator[Chunk]:
        """The job's chunks; the job is cancelled when the client disconnects or the reader stops early."""

        async def watch_disconnect():
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            job.cancel.set()

        watcher = asyncio.create_task(watch_disconnect())
        try:
            async for chunk in job.chunks():
                yield chunk
        finally:
            watcher.cancel()
            job.cancel.set()  # a no-op once the job has finished


class _Reply:
    """Builds the response objects of one completion, whole or as server-sent events."""

    def __init__(self, shape, model_id: str, job: Job, fingerprint: str):
        self.shape, self.job = shape, job
        self.head = {
            "id": shape.id_prefix + secrets.token_hex(12),
            "created": int(time.time()),
            "model": model_id,
            "system_fingerprint": fingerprint,
        }

    def usage(self) -> dict:
        stats = self.job.stats
        return {
            "prompt_tokens": stats.n_prompt,
            "completion_tokens": stats.n_generated,
            "total_tokens": stats.n_prompt + stats.n_generated,
        }

    async def whole(self, first: Chunk, rest: AsyncIterator[Chunk]) -> dict:
        text, finish = [first.text], first.finish_reason
        async for chunk in rest:
            text.append(chunk.text)
            finish = chunk.finish_reason or finish
        return {
            **self.head,
            "object": self.shape.object,
            "choices": [self.shape.choice("".join(text), finish)],
            "usage": self.usage(),
            "flashtree": self.job.stats.as_dict(),
        }

    def _event(self, choices: list[dict], include_usage: bool, **extra) -> str:
        body = {**self.head, "object": self.shape.chunk_object, "choices": choices, **extra}
        if include_usage:  # as OpenAI does: null on every chunk but the last
            body.setdefault("usage", None)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def sse(self, first: Chunk, rest: AsyncIterator[Chunk], include_usage: bool) -> AsyncIterator[str]:
        """Text deltas, then a chunk with the finish reason and stats, the usage chunk if asked, [DONE].
        A cancelled job (client gone) ends without them."""
        shape = self.shape
        if shape.opening is not None:
            yield self._event([shape.delta(shape.opening, None)], include_usage)
        finish = None
        chunk: Chunk | None = first
        while chunk is not None:
            if chunk.text:
                yield self._event([shape.delta({shape.text_key: chunk.text}, None)], include_usage)
            finish = chunk.finish_reason or finish
            chunk = await anext(rest, None)
        if finish is None:
            return
        yield self._event([shape.delta({}, finish)], include_usage, flashtree=self.job.stats.as_dict())
        if include_usage:
            yield self._event([], True, usage=self.usage())
        yield "data: [DONE]\n\n"


def model_id_for(target: Path | None) -> str:
    """The name clients use in "model": the default target's name, else the GGUF file's stem."""
    return DEFAULT_TARGET_NAME if target is None else Path(target).stem


def _listen_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a taken port is reported at once. The protocol is named: asyncio
    turns Nagle's algorithm off only on sockets whose proto is IPPROTO_TCP, and with it on every answer
    (headers, then body) waited ~40 ms for the client's delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise FlashtreeError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port") from e
    return sock


@dataclass(frozen=True)
class ServeConfig:
    """The `flashtree serve` options beside the engine's: where it listens and what it admits."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # required as 'Authorization: Bearer KEY' on every route but /health
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413 before they are read
    max_queue: int = DEFAULT_MAX_QUEUE  # requests that may wait for the engine; more get 429

    def __post_init__(self) -> None:
        check_api_key(self.api_key)
        for name, value, low, high in [
            ("--max-request-bytes", self.max_request_bytes, 1024, 1 << 30),
            ("--max-queue", self.max_queue, 1, 1 << 20),
        ]:
            if not low <= value <= high:
                raise FlashtreeError(f"{name} must be between {low} and {high}, got {value}")


def serve_command(config: EngineConfig, options: ServeConfig) -> None:
    import uvicorn

    from flashtree.cli.commands import load_engine

    host, port = options.host, options.port
    sock = _listen_socket(host, port)
    engine = load_engine(config)
    server = OpenAIServer(
        engine, model_id_for(config.target), options.api_key, options.max_request_bytes, options.max_queue
    )
    bound_port = sock.getsockname()[1]
    print(
        f"flashtree: serving {server.model_id} ({engine.mode}, {engine.max_ctx}-token context) "
        f"at http://{host}:{bound_port}/v1 (ready when /health answers 200)",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(server.app, log_level="info", timeout_graceful_shutdown=3)
    uvicorn.Server(config).run(sockets=[sock])
