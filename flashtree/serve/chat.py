"""`flashtree chat`: a terminal REPL that streams replies and keeps the conversation in the chat template.

Commands: /reset (forget the conversation; the system prompt stays), /system TEXT (set the system prompt;
/system alone clears it), /stats (the last reply's speed and acceptance), /help, /quit or /exit (also
`quit` or `exit` alone on a line, as in psql, and Ctrl-D). Ctrl-C stops a reply.
"""

from __future__ import annotations

import signal

from prompt_toolkit import PromptSession
from rich.console import Console

from flashtree.config import EngineConfig, SamplingParams
from flashtree.engine.generate import Engine, GenerationStats
from flashtree.errors import FlashtreeError

HELP = (
    "/reset forget the conversation (the system prompt stays) · /system TEXT set the system prompt · "
    "/stats last reply's speed · Ctrl-C stop a reply · /quit, /exit or Ctrl-D quit"
)
QUIT = ("/quit", "/exit", "quit", "exit")


class ChatSession:
    """The conversation so far and the REPL around it."""

    def __init__(
        self, engine: Engine, name: str, sampling: SamplingParams, max_tokens: int, console: Console
    ):
        self.engine, self.name, self.console = engine, name, console
        self.sampling, self.max_tokens = sampling, max_tokens
        self.system: str | None = None
        self.turns: list[dict] = []  # user and assistant messages, alternating
        self.last_stats: GenerationStats | None = None

    def run(self) -> None:
        session = PromptSession()
        self.console.print(f"flashtree chat · {self.name} ({self.engine.mode})", style="bold")
        self.console.print(HELP, style="dim")
        while True:
            try:
                line = session.prompt("> ").strip()
            except KeyboardInterrupt:  # Ctrl-C at the prompt clears the line, as in a shell
                continue
            except EOFError:
                return
            if line in QUIT:
                return
            if line.startswith("/"):
                self.command(line)
            elif line:
                self.reply(line)

    def command(self, line: str) -> None:
        name, _, arg = line.partition(" ")
        if name == "/reset":
            self.turns = []
            kept = " (the system prompt stays: /system alone clears it)" if self.system else ""
            self.console.print(f"conversation cleared{kept}", style="dim")
        elif name == "/system":
            self.system = arg.strip() or None
            self.console.print(f"system prompt {'set' if self.system else 'cleared'}", style="dim")
        elif name == "/stats":
            self.console.print(self.describe_stats(), style="dim")
        elif name == "/help":
            self.console.print(HELP, style="dim")
        else:
            self.console.print(f"unknown command {name}; {HELP}", style="yellow")

    def messages(self, user_text: str) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.turns, {"role": "user", "content": user_text}]

    def reply(self, user_text: str) -> None:
        """Stream the assistant's reply; a stopped reply is kept as far as it got, since that is what
        the user saw."""
        stats = GenerationStats(self.engine.mode)
        parts: list[str] = []
        # Ctrl-C must raise here whatever the prompt library left installed: in one CI run a ^C was
        # echoed mid-reply and the reply ran on to its end.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            prompt_ids = self.engine.encode_messages(self.messages(user_text))
            for chunk in self.engine.stream(prompt_ids, self.max_tokens, self.sampling, stats=stats):
                parts.append(chunk.text)
                self.console.out(chunk.text, end="", highlight=False)
        except FlashtreeError as e:
            self.console.print(f"error: {e} (/reset starts over)", style="red")
            return
        except KeyboardInterrupt:
            self.console.out("")
            self.console.print("[stopped]", style="dim", markup=False)
        else:
            self.console.out("")
        self.turns.append({"role": "user", "content": user_text})
        self.turns.append({"role": "assistant", "content": "".join(parts)})
        self.last_stats = stats

    def describe_stats(self) -> str:
        s = self.last_stats
        if s is None:
            return "no reply yet"
        return (
            f"{s.mode}: {s.n_generated} tokens at {s.decode_tok_s:.1f} tok/s "
            f"(prompt {s.n_prompt} tokens at {s.prefill_tok_s:.1f} tok/s), "
            f"mean acceptance length {s.mean_accept_len:.2f} over {s.steps} steps"
        )


def chat_command(config: EngineConfig, sampling: SamplingParams, max_tokens: int) -> None:
    from flashtree.cli.commands import load_engine
    from flashtree.serve.api import model_id_for

    engine = load_engine(config)
    ChatSession(engine, model_id_for(config.target), sampling, max_tokens, Console(highlight=False)).run()
