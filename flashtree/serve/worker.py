"""One thread owns the engine, warms it up, and serves queued requests in arrival order.

The engine is batch-1 and not thread-safe, so every generation runs on this thread. Request handlers
(on the asyncio loop) submit a Job and read its chunks back through an asyncio queue; setting the job's
`cancel` event (the client went away) makes the engine stop at the next step, or skips the job if it has
not started yet.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from flashtree.config import SamplingParams
from flashtree.engine.generate import Chunk, Engine, GenerationStats
from flashtree.errors import FlashtreeError

log = logging.getLogger("flashtree.serve")

_END = object()  # posted after the last chunk of a job


@dataclass
class Job:
    """One request's generation. `stats` is final once `chunks()` is exhausted."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    stats: GenerationStats
    loop: asyncio.AbstractEventLoop
    cancel: threading.Event = field(default_factory=threading.Event)
    _events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def post(self, item) -> None:
        """From the worker thread: hand a chunk, an exception or _END to the waiting handler."""
        try:
            self.loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the event loop closed (server shutting down): nobody is listening
            self.cancel.set()

    async def chunks(self) -> AsyncIterator[Chunk]:
        """The reply's chunks as the engine produces them; re-raises an error of the generation.
        After a cancel the last chunk has no finish_reason."""
        while (item := await self._events.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item


class Metrics:
    """Totals for GET /metrics, written by the worker thread and by request handlers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # by outcome: stop, length, cancelled, rejected, failed
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.decode_steps = 0
        self.step_tokens = 0  # tokens emitted by decode steps, for the mean acceptance length
        self.decode_tokens = 0  # generated tokens after each reply's first (which comes from prefill)
        self.decode_s = 0.0

    def record_generation(self, stats: GenerationStats, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] += 1
            self.prompt_tokens += stats.n_prompt
            self.generated_tokens += stats.n_generated
            self.decode_steps += stats.steps
            self.step_tokens += sum(n * count for n, count in enumerate(stats.accept_hist))
            self.decode_tokens += max(stats.n_generated - 1, 0)
            self.decode_s += stats.decode_s

    def record_outcome(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] += 1

    def render(self, queued: int) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        with self._lock:
            mean_accept = self.step_tokens / self.decode_steps if self.decode_steps else 0.0
            tok_s = self.decode_tokens / self.decode_s if self.decode_s else 0.0
            families = [
                ("requests_total", "counter", "Completion requests by outcome.", dict(self.requests)),
                ("prompt_tokens_total", "counter", "Prompt tokens processed.", self.prompt_tokens),
                ("generated_tokens_total", "counter", "Tokens generated.", self.generated_tokens),
                ("decode_steps_total", "counter", "Decode steps (one target pass each).", self.decode_steps),
                ("mean_accept_len", "gauge", "Tokens emitted per decode step, all requests.", mean_accept),
                ("decode_tokens_per_second", "gauge", "Decode throughput, all requests.", tok_s),
                ("queued_requests", "gauge", "Requests waiting for the engine.", queued),
            ]
        lines = []
        for name, kind, help_text, value in families:
            lines += [f"# HELP flashtree_{name} {help_text}", f"# TYPE flashtree_{name} {kind}"]
            if isinstance(value, dict):
                lines += [f'flashtree_{name}{{outcome="{k}"}} {v}' for k, v in sorted(value.items())]
            else:
                lines.append(f"flashtree_{name} {value}")
        return "\n".join(lines) + "\n"


class EngineUnavailable(Exception):
    """The engine failed its warm-up forward: no request can be served (the reason is the message)."""


WARMING, READY, FAILED = "warming", "ready", "failed"


class EngineWorker:
    """The engine's thread and its waiting jobs. The thread first runs a warm-up generation: until it
    passes the worker is `warming` (jobs wait), and if it fails the worker is `failed` for good and every
    job is answered with EngineUnavailable."""

    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.engine, self.metrics = engine, metrics
        self.state, self.failure = WARMING, None
        self.job_s = 1.0  # a running mean of how long a job holds the engine, for Retry-After
        self._waiting: deque[Job] = deque()
        self._changed = threading.Condition()
        self._stopping = False
        self._current: Job | None = None
        self._thread = threading.Thread(target=self._serve, name="flashtree-engine", daemon=True)

    @property
    def queued(self) -> int:
        """Jobs waiting for the engine (not the running one; a cancelled job no longer waits)."""
        with self._changed:
            return sum(not job.cancel.is_set() for job in self._waiting)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Cancel the running and the waiting jobs and end the thread."""
        with self._changed:
            self._stopping = True
            for job in [self._current, *self._waiting]:
                if job is not None:
                    job.cancel.set()
            self._changed.notify()
        self._thread.join(timeout=10)

    def submit(
        self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, stop: list[str]
    ) -> Job:
        """Queue a generation; call from the event loop that will read the job's chunks. Raises
        EngineUnavailable after a failed warm-up."""
        if self.failure is not None:
            raise EngineUnavailable(self.failure)
        stats = GenerationStats(self.engine.mode)
        job = Job(prompt_ids, max_tokens, sampling, stop, stats, asyncio.get_running_loop())
        with self._changed:
            self._waiting.append(job)
            self._changed.notify()
        return job

    def _next(self) -> Job | None:
        with self._changed:
            while not self._waiting and not self._stopping:
                self._changed.wait()
            self._current = self._waiting.popleft() if self._waiting else None
            return self._current

    def _serve(self) -> None:
        self._warm_up()
        while (job := self._next()) is not None:
            started = time.monotonic()
            if self.failure is not None:
                job.post(EngineUnavailable(self.failure))
            else:
                self._run(job)
            self.job_s = 0.8 * self.job_s + 0.2 * (time.monotonic() - started)
            with self._changed:
                self._current = None

    def _warm_up(self) -> None:
        """One prefill and one decode step on a one-token prompt: a model that cannot run a forward is
        found here, not by every request."""
        bos = getattr(self.engine.tokenizer, "bos_id", None)
        try:
            for _ in self.engine.generate([bos or 0], 2, SamplingParams(), stop_ids=()):
                pass
        except Exception as e:  # any failure at all: the server stays up to say so
            log.exception("the warm-up generation failed; every request will be answered 503")
            self.failure = f"the model failed its warm-up forward: {type(e).__name__}: {e}"
            self.state = FAILED
            return
        self.state = READY

    def _run(self, job: Job) -> None:
        if job.cancel.is_set():  # the client left while the job was queued
            self.metrics.record_outcome("cancelled")
            job.post(_END)
            return
        finish = None
        try:
            for chunk in self.engine.stream(
                job.prompt_ids, job.max_tokens, job.sampling, job.stop, job.stats, job.cancel
            ):
                finish = chunk.finish_reason
                job.post(chunk)
        except FlashtreeError as e:  # a bad request (the handler answers 400 and counts it)
            job.post(e)
            return
        except Exception as e:  # a bug of ours: report it to this request and keep serving the others
            log.exception("generation failed")
            self.metrics.record_outcome("failed")
            job.post(e)
            return
        self.metrics.record_generation(job.stats, finish or "cancelled")
        job.post(_END)
