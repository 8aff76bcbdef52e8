"""The engine: one target (and optionally a DFlash draft) behind one token-stream API.

`Engine.generate` yields the token ids committed by each step; `Engine.stream` turns them into
text chunks (incremental UTF-8-safe detokenization, stop strings, finish reason). run, chat,
serve and bench all use these two and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from flashtree.config import EngineConfig, SamplingParams, SpecConfig, check_attn_window, lossy_label
from flashtree.engine.cuda_graphs import StepRunner, graphs_wanted
from flashtree.engine.memory import free_bytes, plan_context, use_expandable_segments
from flashtree.engine.prefill import prefill_chunk
from flashtree.engine.sampling import SEED_MASK, sample
from flashtree.errors import FlashtreeError
from flashtree.models.model import DecoderModel
from flashtree.settings import Settings
from flashtree.settings import current as current_settings
from flashtree.spec.accept import Accepted


@dataclass
class Chunk:
    """One piece of a streamed reply. The last chunk carries finish_reason ("stop" or "length")."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class GenerationStats:
    mode: str
    n_prompt: int = 0
    n_generated: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0  # decode steps after the first token
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[n] = steps that emitted n tokens
    lossy: str | None = None  # the engine's `lossy`: what makes the output differ from the model's

    def record_step(self, n_emitted: int) -> None:
        self.steps += 1
        if len(self.accept_hist) <= n_emitted:
            self.accept_hist.extend([0] * (n_emitted + 1 - len(self.accept_hist)))
        self.accept_hist[n_emitted] += 1

    @property
    def mean_accept_len(self) -> float:
        """Accepted draft tokens + 1 (the bonus), averaged over decode steps."""
        total = sum(n * c for n, c in enumerate(self.accept_hist))
        return total / self.steps if self.steps else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first one, per second of decoding (the first comes from prefill)."""
        return max(self.n_generated - 1, 0) / self.decode_s if self.decode_s else 0.0

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "n_prompt": self.n_prompt,
            "n_generated": self.n_generated,
            "prefill_tok_s": self.prefill_tok_s,
            "decode_tok_s": self.decode_tok_s,
            "steps": self.steps,
            "mean_accept_len": self.mean_accept_len,
            "accept_hist": list(self.accept_hist),
            "lossy": self.lossy,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    """Owns the target, its tokenizer, an optional draft, and one sequence's state (batch 1)."""

    def __init__(
        self,
        target: DecoderModel,
        tokenizer,
        draft=None,
        spec: SpecConfig | None = None,
        max_ctx: int | None = None,
        settings: Settings | None = None,
        attn_window: int = 0,
        kv_types: tuple[str | None, str | None] | None = None,
        planned: bool = False,
    ):
        """attn_window > 0: the decode steps' attention reads each row's last attn_window positions only
        (--attn-window: lossy, `lossy`); the prefill stays full attention. planned: max_ctx is the
        memory plan's (engine/plan.py, Engine.load), which already counted the workspace that the
        free-memory guard of an engine built directly keeps a margin for."""
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        if kv_types is not None:  # the KV cache's K and V types (quant/kv.py), checked on the heads
            target.set_kv_types(*kv_types)
        self.kv_types = target.resolved_kv_types
        self.settings = settings or current_settings()  # the process's FLASHTREE_* unless given
        self.spec = spec or SpecConfig(mode="tree" if draft is not None else "ar")
        if self.spec.mode != "ar" and draft is None:
            raise FlashtreeError(f"mode {self.spec.mode!r} needs a draft (--draft)")
        self.attn_window = check_attn_window(attn_window)
        self.decoder = None
        if self.spec.mode != "ar":
            from flashtree.spec.decoder import SpecDecoder

            self.decoder = SpecDecoder(target, draft, self.spec, window=attn_window)
        # Spare slots past max_ctx so a verify block near the end of the context still fits.
        headroom = self.decoder.max_block if self.decoder else 1
        verify = headroom if self.decoder else 0
        self.max_ctx = max_ctx if planned else plan_context(target, max_ctx, headroom, verify_tokens=verify)
        self.state = target.new_state(self.max_ctx + headroom)
        # Each step's inputs, as device tensors a captured step reads: the token, the sampling seed.
        self.root = torch.zeros((), dtype=torch.long, device=self.device)
        self.seed = torch.zeros((), dtype=torch.long, device=self.device)
        fixed = self.decoder is None or self.decoder.fixed_shape
        graphs = fixed and graphs_wanted(self.device, self.settings.cuda_graphs)
        self.runner = StepRunner(self.state, graphs=graphs)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def mode(self) -> str:
        return self.spec.mode

    @property
    def lossy(self) -> str | None:
        """What makes this engine's output differ from the full-attention model's, or None (lossless)."""
        return lossy_label(self.attn_window)

    @classmethod
    def load(
        cls,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        mode: str | None = None,
        spec: SpecConfig | None = None,
        max_ctx: int | None = None,
        device: str | None = None,
        settings: Settings | None = None,
        attn_window: int = 0,
        kv_types: tuple[str | None, str | None] | None = None,
    ) -> Engine:
        """Load a target GGUF and a draft ('none' for plain decoding), each a path or a model store's name
        (gguf/locate.py). With no target: the embedded default, SmolLM2-135M-Instruct, and (unless a draft
        is given) the draft shipped for it. mode "auto": auto_mode for the device and draft.
        settings: the process's (FLASHTREE_*) unless given."""
        from flashtree import defaults
        from flashtree.config import AUTO, auto_mode
        from flashtree.engine.plan import plan_load
        from flashtree.gguf.locate import resolve_model
        from flashtree.gguf.tokenizer import Tokenizer
        from flashtree.models.layers import use_kernels
        from flashtree.models.loader import load_target, resolve_device

        settings = settings or current_settings()
        if target is None:
            target = defaults.default_target_path()
            draft = defaults.default_draft_path() if draft is None else draft
        cuda = resolve_device(device).type == "cuda"
        if cuda:
            use_expandable_segments(settings.expandable_segments)
        forced = settings.quant_kernels if cuda else None
        draft = resolve_model(draft) if draft not in (None, "none") else draft
        target = resolve_model(target)
        max_ctx = plan_load(
            target, draft, mode, spec, max_ctx, resolve_device(device), settings, kv_types or (None, None)
        )
        model, gguf = load_target(target, device=device, quantized=forced)
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
        draft_model = None
        if draft not in (None, "none"):
            from flashtree.models.dflash import load_draft

            draft_model = load_draft(draft, model, settings.draft_fp8)
        spec = spec or SpecConfig()
        mode = auto_mode(cuda, draft_model is not None) if mode == AUTO else mode
        mode = mode or ("ar" if draft_model is None else spec.mode)
        spec = replace(spec, mode=mode)
        speculative = draft_model is not None and mode != "ar"
        use_kernels(model, settings.kernels, speculative)
        return cls(
            model,
            tokenizer,
            draft_model,
            spec,
            max_ctx,
            settings,
            attn_window,
            kv_types=kv_types,
            planned=True,
        )

    @classmethod
    def from_config(cls, config: EngineConfig, settings: Settings | None = None) -> Engine:
        """Engine.load of an EngineConfig (the commands build one from their options)."""
        c = config
        kv_types = (c.kv_type_k, c.kv_type_v)
        return cls.load(
            c.target, c.draft, c.mode, c.spec, c.max_ctx, c.device, settings, c.attn_window, kv_types=kv_types
        )

    def encode(self, text: str, chat: bool = True, system: str | None = None) -> list[int]:
        """Prompt ids for `text`, through the chat template unless chat=False."""
        if not chat:
            return self.tokenizer.encode(text)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}
        ]
        return self.encode_messages(messages)

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """Prompt ids of a conversation; control-token text in a message's content is plain text."""
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True)

    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams | None = None,
        stop_ids: Iterable[int] | None = None,
        stats: GenerationStats | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> Iterator[list[int]]:
        """Yield the tokens each step commits, until a stop id (included), max_tokens or a full context.
        `on_prefill(done, total)`: called after each prefill chunk (a long prompt's progress)."""
        sampling = sampling or SamplingParams()
        stop = set(self.tokenizer.stop_ids if stop_ids is None else stop_ids)
        stats = stats if stats is not None else GenerationStats(self.mode)
        self._check_prompt(prompt_ids, max_tokens)
        budget = min(max_tokens, self.max_ctx - len(prompt_ids))
        stats.n_prompt, stats.lossy = len(prompt_ids), self.lossy

        t0 = time.perf_counter()
        token = self._prefill(prompt_ids, sampling, on_prefill)
        _sync(self.device)
        stats.prefill_s = time.perf_counter() - t0
        emitted = self._clip([token], budget, stop)
        t0 = time.perf_counter()
        while True:
            stats.n_generated += len(emitted)
            yield emitted
            if stats.n_generated >= budget or emitted[-1] in stop:
                break
            # A step's count is what it emits: tokens accepted past max_tokens or a stop id are not.
            emitted = self._clip(self._step(emitted[-1], sampling), budget - stats.n_generated, stop)
            stats.record_step(len(emitted))
            stats.decode_s = time.perf_counter() - t0

    def _check_prompt(self, prompt_ids: list[int], max_tokens: int) -> None:
        if not prompt_ids:
            raise FlashtreeError("the prompt is empty")
        if max_tokens < 1:
            raise FlashtreeError(f"max_tokens must be >= 1, got {max_tokens}")
        if len(prompt_ids) >= self.max_ctx:
            raise FlashtreeError(
                f"prompt of {len(prompt_ids)} tokens does not fit the {self.max_ctx}-token context"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.target.config.vocab]
        if bad:
            raise FlashtreeError(f"token id {bad[0]} is outside the vocabulary of {self.target.config.vocab}")

    @staticmethod
    def _clip(tokens: list[int], room: int, stop: set[int]) -> list[int]:
        tokens = tokens[:room]
        for i, t in enumerate(tokens):
            if t in stop:
                return tokens[: i + 1]
        return tokens

    def _prefill(self, prompt_ids: list[int], sampling: SamplingParams, on_prefill: Callable | None) -> int:
        """Run the prompt in chunks (feeding its features to the draft, chunk by chunk, so a long
        prompt never holds more than one chunk of them) and sample the first new token."""
        self.state.reset()
        if self.decoder:
            self.decoder.reset()
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        free = free_bytes(self.device)
        chunk = prefill_chunk(
            self.target.config, len(prompt_ids), free, self.device.type, self.settings.prefill_chunk
        )
        capture = self.decoder.capture_layers if self.decoder else ()
        for s in range(0, len(prompt_ids), chunk):
            part, last = ids[s : s + chunk], s + chunk >= len(prompt_ids)
            out = self.target(part, self.state, logits="last" if last else "none", capture=capture)
            self.state.advance(part.shape[0])
            if self.decoder:
                self.decoder.observe(out.features)
            if on_prefill:
                on_prefill(min(s + chunk, len(prompt_ids)), len(prompt_ids))
        pos = torch.full((1,), len(prompt_ids), device=self.device)
        return int(sample(out.logits, sampling, pos)[0])

    def _step(self, root: int, sampling: SamplingParams) -> list[int]:
        """One decode step from the last emitted token: AR, or draft -> verify -> accept. The device
        work runs eagerly or from a CUDA graph (StepRunner); then one read-back and the host's books."""
        # fill kernels; torch.tensor would copy from the host and wait for the GPU
        self.root.fill_(root)
        if not sampling.greedy:  # greedy steps never read the seed
            self.seed.fill_(sampling.seed & SEED_MASK)
        block = self.decoder.max_block if self.decoder else 1
        self.state.check_room(block)
        n_keys = self.runner.n_keys(self.state.seq_len + block)
        key = (n_keys, replace(sampling, seed=0))  # the seed is an input, not part of the graph
        if self.decoder:
            step = lambda: self.decoder.step(self.root, self.state, sampling, self.seed, n_keys)  # noqa: E731
            packed = self.runner.run(key, step).tolist()  # the step's one host sync
            self.state.advance(packed[0])
            return Accepted.emitted(packed)
        token = int(self.runner.run(key, lambda: self._ar_step(sampling, n_keys)))  # the one sync
        self.state.advance(1)
        return [token]

    def _ar_step(self, sampling: SamplingParams, n_keys: int | None) -> torch.Tensor:
        out = self.target(
            self.root.view(1), self.state, logits="last", n_keys=n_keys, window=self.attn_window
        )
        # (1,): sampled for the position the token takes
        return sample(out.logits, sampling, self.state.position.view(1), self.seed)

    def stream(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams | None = None,
        stop: Iterable[str] = (),
        stats: GenerationStats | None = None,
        cancel=None,
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> Iterator[Chunk]:
        """Text chunks of the reply. Stop strings are matched across token boundaries and never
        emitted; stop tokens (EOS/EOT) end the reply without appearing in the text. `cancel` (a
        threading.Event) ends generation between steps; `on_prefill` as in `generate`."""
        from flashtree.gguf.tokenizer import IncrementalDecoder

        stops = [s for s in stop if s]
        stop_ids = set(self.tokenizer.stop_ids)
        decoder = IncrementalDecoder(self.tokenizer)
        held = ""  # decoded text that may still turn out to start a stop string
        for ids in self.generate(prompt_ids, max_tokens, sampling, stop_ids, stats, on_prefill):
            ended_by_token = ids[-1] in stop_ids
            held += decoder.push([t for t in ids if t not in stop_ids])
            if ended_by_token:
                held += decoder.flush()
            cut = _first_stop(held, stops)
            if cut is not None:
                yield Chunk(held[:cut], ids, "stop")
                return
            if ended_by_token:
                yield Chunk(held, ids, "stop")
                return
            keep = _partial_stop_len(held, stops)
            yield Chunk(held[: len(held) - keep], ids)
            held = held[len(held) - keep :]
            if cancel is not None and cancel.is_set():
                return
        tail = held + decoder.flush()
        cut = _first_stop(tail, stops)
        yield Chunk(tail if cut is None else tail[:cut], [], "length" if cut is None else "stop")


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-n:]):
                best = n
                break
    return best
