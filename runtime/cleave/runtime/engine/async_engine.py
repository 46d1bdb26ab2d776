"""An asyncio front for the engine: submit a request, iterate its token deltas.

The step loop runs in one background thread (torch releases the GIL inside its kernels, so
the event loop stays responsive). Requests and aborts cross into that thread through a queue;
outputs come back with ``call_soon_threadsafe``. Validation happens in the caller, so a bad
request fails at once with a :class:`RequestError` and never reaches the loop.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import queue
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.engine.outputs import KVHandoff, RequestOutput
from cleave.runtime.engine.sequence import SamplingParams, Sequence


@dataclass(frozen=True)
class _Add:
    seq: Sequence
    kv: KVHandoff | None


@dataclass(frozen=True)
class _Abort:
    request_id: str


_Command = _Add | _Abort | None


class EngineDeadError(RuntimeError):
    """The step loop failed; every request in flight ends with this error."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop,
                                       asyncio.Queue[RequestOutput | BaseException]]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="cleave-engine", daemon=True)
        self._dead: BaseException | None = None
        self._thread.start()

    # -- caller side ---------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams, *,
                       request_id: str | None = None, prefill_only: bool = False,
                       kv: KVHandoff | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Yield one :class:`RequestOutput` per step until the request finishes.

        Leaving the loop early (break, cancellation, client disconnect) aborts the request
        and frees its KV blocks.
        """
        if self._dead is not None:
            raise EngineDeadError(f"engine loop stopped: {self._dead!r}")
        rid = request_id or f"req-{next(self._ids)}"
        make = functools.partial(self.engine.make_sequence, rid, prompt, params,
                                 prefill_only=prefill_only, kv=kv)
        # A grammar compiles here (llguidance's view of the tokenizer once, about a second; a
        # large schema in tens of milliseconds): off the event loop, other streams go on.
        seq = await asyncio.to_thread(make) if params.grammar is not None else make()
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            # Checked under the lock the dying loop also takes: a request can never slip in
            # after the loop told every waiter it died, and then wait forever.
            if self._dead is not None:
                raise EngineDeadError(f"engine loop stopped: {self._dead!r}")
            if rid in self._streams:
                raise ValueError(f"request id '{rid}' is already in flight")
            self._streams[rid] = (asyncio.get_running_loop(), stream)
        self._commands.put(_Add(seq, kv))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                self._commands.put(_Abort(rid))

    def shutdown(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=10)

    # -- engine thread -------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self.engine.abort(command.request_id)
            return
        try:
            outputs = self.engine.enqueue(command.seq, command.kv)
        except Exception as e:  # a duplicate id, for one: that request fails, no other
            self._deliver(command.seq.request_id, e)
            return
        for out in outputs:
            self._deliver(out.request_id, out)

    def _drain(self, block: bool) -> bool:
        """Apply every queued command; False once shutdown was asked for."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while command is not None:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _run(self) -> None:
        try:
            while self._drain(block=not self.engine.has_unfinished):
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
            self._stop(EngineDeadError("the engine was shut down"))
        except BaseException as e:  # every waiter must learn that the loop died
            self._stop(e)

    def _stop(self, reason: BaseException) -> None:
        with self._lock:
            self._dead = reason
            pending = list(self._streams.items())
        for _, (loop, stream) in pending:
            loop.call_soon_threadsafe(stream.put_nowait,
                                      EngineDeadError(f"engine loop stopped: {reason!r}"))

    @property
    def dead(self) -> BaseException | None:
        """Why the step loop stopped, or None while it runs."""
        return self._dead


async def last_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Run a request to its end; its final output (prefill-only requests have just one)."""
    last: RequestOutput | None = None
    async for out in stream:
        last = out
    if last is None:
        raise RuntimeError("the request produced no output")
    return last
