"""The chaos run's traffic: multi-turn conversations on shared system prompts, at a steady rate.

The serving benchmark's workload family, open-ended: ``active`` conversations run at once,
each of ``turns`` turns; a finished conversation is replaced by a new user. Every
``1 / rate`` seconds the conversation idle longest sends its next turn (none idle: that slot
is skipped); user ``u``'s turn ``t`` goes to server ``(u + t) mod n``, so each turn meets
history that the other server computed and saved to the pool. Some clients hang up on
purpose: before the first token (after a random fraction of a second) or mid-decode (after
some tokens). Each request is a :class:`~testing.chaos_history.RequestRecord`, its times in
seconds since ``t0``; a turn that failed leaves an empty answer in the conversation.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.serving import SERVED_NAME
from testing.chaos_history import (
    BEFORE_FIRST_TOKEN,
    COMPLETED,
    DISCONNECTED,
    FAILED,
    MID_DECODE,
    REFUSED,
    TIMED_OUT,
    RequestRecord,
)


@dataclass(frozen=True)
class Workload:
    """The conversations and how they arrive; every field is printed with the results."""

    system_prompts: int = 2
    system_len: int = 192
    first_len: int = 64
    question_len: int = 32
    answer_len: int = 8
    turns: int = 4
    active: int = 6
    rate: float = 1.5  # requests per second
    disconnect_chance: float = 0.15
    vocab: int = 500
    seed: int = 33

    def describe(self) -> str:
        return (
            f"{self.system_prompts} system prompts x {self.system_len} tokens, {self.active} "
            f"conversations at a time of {self.turns} turns (first message {self.first_len} tokens, "
            f"then {self.question_len}; answers {self.answer_len}), {self.rate:g} requests/s, "
            f"{self.disconnect_chance:.0%} of clients hang up early; seed {self.seed}"
        )


class Conversations:
    """Seeded token ids of every user's messages; prompts from the answers so far."""

    def __init__(self, wl: Workload):
        self.wl = wl
        rng = random.Random(wl.seed)
        self.systems = [self._ids(rng, wl.system_len) for _ in range(wl.system_prompts)]

    def _ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(3, self.wl.vocab) for _ in range(n)]

    def message(self, user: int, turn: int) -> list[int]:
        rng = random.Random(self.wl.seed * 1_000_003 + user * 101 + turn)
        return self._ids(rng, self.wl.first_len if turn == 0 else self.wl.question_len)

    def prompt(self, user: int, turn: int, answers: Sequence[list[int]]) -> list[int]:
        out = list(self.systems[user % self.wl.system_prompts])
        for t in range(turn):
            out += self.message(user, t) + answers[t]
        return out + self.message(user, turn)


@dataclass
class Conversation:
    user: int
    answers: list[list[int]] = field(default_factory=list)
    busy: bool = False
    idle_since: float = 0.0


@dataclass
class Traffic:
    """Drives the workload against ``urls()`` (read per request: a restarted server keeps its URL)."""

    wl: Workload
    urls: Callable[[], list[str]]
    t0: float
    client_timeout_s: float
    on_record: Callable[[RequestRecord], None]
    phase: str = "chaos"
    first_user: int = 0
    in_flight: dict[int, int] = field(default_factory=dict)  # per server
    completed: list[RequestRecord] = field(default_factory=list)
    _ids: int = 0
    _waiting: set[int] = field(default_factory=set)  # users whose next turn is not sent yet

    def goes_on(self, record: RequestRecord) -> bool:
        """Whether ``record``'s conversation has a next turn not sent yet."""
        return record.user in self._waiting and record.turn + 1 < self.wl.turns

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, seconds: float, keep_going: Callable[[], bool] | None = None) -> None:
        """Send a turn every ``1 / rate`` s for ``seconds`` (and on while ``keep_going()``), then wait
        for every request (each bounded by the client timeout)."""
        import aiohttp

        convs = Conversations(self.wl)
        rng = random.Random(f"{self.wl.seed}/{self.phase}")
        next_user = self.first_user
        active: list[Conversation] = []
        tasks: set[asyncio.Task[None]] = set()
        timeout = aiohttp.ClientTimeout(total=self.client_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, read_bufsize=1 << 20) as session:
            start = self.now()
            slot = 0
            while self.now() - start < seconds or (keep_going is not None and keep_going()):
                await asyncio.sleep(max(0.0, start + slot / self.wl.rate - self.now()))
                slot += 1
                active = [c for c in active if len(c.answers) < self.wl.turns or c.busy]
                while len(active) < self.wl.active:
                    active.append(Conversation(next_user))
                    next_user += 1
                idle = [c for c in active if not c.busy and len(c.answers) < self.wl.turns]
                if not idle:
                    continue
                conv = min(idle, key=lambda c: c.idle_since)
                conv.busy = True
                self._waiting.discard(conv.user)
                task = asyncio.create_task(self._turn(session, convs, conv, rng.random()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)

    async def _turn(self, session: Any, convs: Conversations, conv: Conversation, draw: float) -> None:
        wl = self.wl
        turn = len(conv.answers)
        server = (conv.user + turn) % len(self.urls())
        prompt = convs.prompt(conv.user, turn, conv.answers)
        plan = None  # a share of the clients hang up, half of them before the first token
        if draw < wl.disconnect_chance:
            plan = BEFORE_FIRST_TOKEN if draw < wl.disconnect_chance / 2 else MID_DECODE
        self._ids += 1
        record = RequestRecord(
            self._ids, server, conv.user, turn, prompt, wl.answer_len, self.now(), phase=self.phase
        )
        record.disconnect = plan
        self.in_flight[server] = self.in_flight.get(server, 0) + 1
        try:
            await self._stream(session, self.urls()[server], record, draw)
        finally:
            self.in_flight[server] -= 1
            if record.ended is None:
                record.ended = self.now()
            conv.answers.append(list(record.tokens))
            conv.busy = False
            conv.idle_since = self.now()
            self._waiting.add(conv.user)
            if record.outcome == COMPLETED:
                self.completed.append(record)
            self.on_record(record)

    async def _stream(self, session: Any, url: str, record: RequestRecord, draw: float) -> None:
        """POST a greedy streaming completion; hang up as planned; note times, tokens and outcome."""
        import aiohttp

        body = {
            "model": SERVED_NAME,
            "prompt": record.prompt,
            "max_tokens": record.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        # Where a planned hang-up happens: a fraction of a second in, or after some tokens.
        hang_up_after_s = 0.05 + draw * 3.0
        hang_up_after_tokens = 1 + int(draw * 1000) % max(1, record.max_tokens - 1)
        try:
            async with asyncio.timeout(self.client_timeout_s):
                await self._read(session, url, body, record, hang_up_after_s, hang_up_after_tokens)
        except TimeoutError:
            record.outcome, record.error = TIMED_OUT, f"no end after {self.client_timeout_s:.0f} s"
        except (OSError, ValueError, aiohttp.ClientError) as exc:  # a broken stream, a refused connection
            refused = isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError)
            record.outcome = REFUSED if refused else FAILED
            record.error = f"{type(exc).__name__}: {exc}"[:300]
        record.ended = self.now()

    async def _read(
        self,
        session: Any,
        url: str,
        body: dict[str, Any],
        record: RequestRecord,
        hang_up_after_s: float,
        hang_up_after_tokens: int,
    ) -> None:
        reading = asyncio.ensure_future(self._read_all(session, url, body, record, hang_up_after_tokens))
        if record.disconnect == BEFORE_FIRST_TOKEN:
            done, _ = await asyncio.wait({reading}, timeout=hang_up_after_s)
            if not done:
                reading.cancel()
                with_tokens = bool(record.tokens)
                record.outcome = DISCONNECTED
                record.error = f"hung up after {hang_up_after_s:.2f} s" + (
                    " (mid-decode)" if with_tokens else ""
                )
                return
        await reading

    async def _read_all(
        self, session: Any, url: str, body: dict[str, Any], record: RequestRecord, hang_up_after_tokens: int
    ) -> None:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                record.outcome = REFUSED
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                if not ids:
                    continue
                if record.first is None:
                    record.first = self.now()
                record.tokens += ids
                if record.disconnect == MID_DECODE and len(record.tokens) >= hang_up_after_tokens:
                    record.outcome, record.error = DISCONNECTED, f"hung up after {len(record.tokens)} tokens"
                    return
        if len(record.tokens) == record.max_tokens:
            record.outcome = COMPLETED
        else:
            record.outcome, record.error = (
                FAILED,
                f"{len(record.tokens)} tokens, expected {record.max_tokens}",
            )


async def references(
    url: str, prompts: Sequence[list[int]], max_tokens: int, concurrency: int = 4
) -> list[list[int]]:
    """Greedy answers of a server without any cache (no prefix caching, no connector)."""
    import aiohttp

    out: list[list[int]] = [[] for _ in prompts]
    gate = asyncio.Semaphore(concurrency)

    async def one(session: Any, index: int) -> None:
        body = {
            "model": SERVED_NAME,
            "prompt": prompts[index],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        async with gate, session.post(f"{url}/v1/completions", json=body) as response:
            reply = await response.json()
            if response.status != 200:
                raise RuntimeError(f"reference request failed: {reply}")
            out[index] = list(reply["choices"][0]["token_ids"])

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(session, i) for i in range(len(prompts))))
    return out
