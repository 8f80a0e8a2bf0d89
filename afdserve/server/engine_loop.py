"""The one thread that owns the EngineClient (which is not thread-safe), and `Generation`, a
handler's asyncio-side view of the engine requests it started.

HTTP handlers never touch the client: they put commands on a thread-safe queue and receive each
SequenceOutput of their request through a `Deliver` callback, which hands it to their asyncio loop.
The thread alternates: apply queued adds and aborts, then `client.step()`.

If `step()` raises anything but a per-request refusal, a rank is gone: every in-flight request is
failed with an EngineFailure, new ones are refused, and `healthy` turns False for good (serve.py
then exits or restarts the ranks). Clients see the first line of the error; the log keeps all of
it, rank tracebacks included.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from afdserve.engine.client import EngineClient, EngineStats
from afdserve.engine.outputs import SequenceOutput
from afdserve.engine.requests import RequestError
from afdserve.engine.sampling_params import SamplingParams
from afdserve.server.convert import Fanout
from afdserve.server.limits import Admission
from afdserve.server.metrics import ServerMetrics
from afdserve.server.protocol import APIError, bad_request, public_message
from afdserve.server.responses import usage

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005  # how long an idle loop waits for a command before stepping again
STOP_TIMEOUT_S = 30.0
CLIENT_GONE = object()  # queued by the disconnect watcher to end a generation's events


@dataclass(frozen=True)
class EngineFailure:
    """Delivered instead of an output when the request can no longer finish."""

    message: str
    status: int = 500


Deliver = Callable[[SequenceOutput | EngineFailure], None]


def asyncio_deliver(q: asyncio.Queue, tag: int) -> Deliver:
    """A Deliver that puts `(tag, item)` on `q` from any thread. Call it inside the event loop."""
    loop = asyncio.get_running_loop()

    def deliver(item: SequenceOutput | EngineFailure) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, (tag, item))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    return deliver


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    deliver: Deliver
    accepted: Future


@dataclass(frozen=True)
class _Abort:
    request_id: str


class EngineLoop:
    def __init__(self, client: EngineClient, idle_wait_s: float = IDLE_WAIT_S) -> None:
        self.client = client
        self.idle_wait_s = idle_wait_s
        self.error: str | None = None
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._routes: dict[str, Deliver] = {}  # owned by the engine thread
        self._closed = False
        self._lock = threading.Lock()  # orders submit() against the thread's exit
        self._stop = threading.Event()
        self._stats: EngineStats | None = None
        self._thread = threading.Thread(target=self._run, name="afdserve-engine", daemon=True)

    # ----- any thread -----
    def start(self) -> EngineLoop:
        self._stats = self.client.stats()
        self._thread.start()
        return self

    @property
    def healthy(self) -> bool:
        return self.error is None and not self._closed and self._thread.is_alive()

    def stats(self) -> EngineStats | None:
        return self._stats

    def submit(
        self, request_id: str, prompt: list[int], params: SamplingParams, deliver: Deliver
    ) -> Future:
        """Queue a request. The future resolves to None once the engine accepted it, or raises
        RequestError (refused: a client error) or RuntimeError (engine down)."""
        accepted: Future = Future()
        with self._lock:
            if self._closed:
                accepted.set_exception(RuntimeError(self.error or "the engine is shutting down"))
            else:
                self._commands.put(_Add(request_id, prompt, params, deliver, accepted))
        return accepted

    def abort(self, request_id: str) -> None:
        with self._lock:
            if not self._closed:
                self._commands.put(_Abort(request_id))

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the thread and fail whatever is in flight; the client itself stays open."""
        self._stop.set()
        self._commands.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ----- the engine thread -----
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply(self._next_commands())
                if self._stop.is_set():
                    break
                self._step()
        except Exception as e:  # a rank died or the client broke: nothing can finish now
            log.exception("engine loop failed")
            self.error = f"engine failed: {public_message(f'{type(e).__name__}: {e}')}"
        finally:
            self._close()

    def _next_commands(self) -> list[_Add | _Abort | None]:
        commands = []
        if not self.client.has_unfinished and not self._routes:
            try:  # idle: sleep on the queue so a new request wakes us at once
                commands.append(self._commands.get(timeout=self.idle_wait_s))
            except queue.Empty:
                pass
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[_Add | _Abort | None]) -> None:
        for cmd in commands:
            if isinstance(cmd, _Add):
                try:
                    self.client.add_request(cmd.request_id, cmd.prompt, cmd.params)
                except RequestError as e:
                    cmd.accepted.set_exception(e)
                    continue
                except Exception as e:
                    message = f"engine failed: {public_message(str(e))}"
                    cmd.accepted.set_exception(RuntimeError(message))
                    raise
                self._routes[cmd.request_id] = cmd.deliver
                cmd.accepted.set_result(None)
            elif isinstance(cmd, _Abort) and self._routes.pop(cmd.request_id, None) is not None:
                self.client.abort(cmd.request_id)

    def _step(self) -> None:
        try:
            outputs = self.client.step()
        except RequestError as e:
            # A rank refused a request the frontend's checks let through. Fail that request when
            # the error says which one; the engine itself is fine.
            request_id = getattr(e, "request_id", None)
            deliver = self._routes.pop(request_id, None) if request_id else None
            if deliver is not None:
                deliver(EngineFailure(str(e), status=400))
            else:
                log.warning("engine refused a request: %s", e)
            return
        for out in outputs:
            deliver = self._routes.get(out.request_id)
            if deliver is None:
                continue  # aborted meanwhile
            if out.finished:
                del self._routes[out.request_id]
            deliver(out)
        self._stats = self.client.stats()

    def _close(self) -> None:
        with self._lock:
            self._closed = True
        message = self.error or "the server is shutting down"
        failure = EngineFailure(message, status=500 if self.error else 503)
        for deliver in self._routes.values():
            deliver(failure)
        if self.error is None:
            for request_id in self._routes:
                try:
                    self.client.abort(request_id)
                except Exception:  # shutting down anyway; the client is closed next
                    log.debug("abort of %s during shutdown failed", request_id, exc_info=True)
        self._routes.clear()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                cmd.accepted.set_exception(RuntimeError(message))


class Generation:
    """The engine requests behind one HTTP request (prompts x candidates), gathered on one queue;
    output i belongs to engine request i.

    Every engine request ends exactly one way in the metrics: finished (stop, length), aborted
    (the client left, or the request timed out: `afdserve_requests_aborted_total`), or failed
    with the engine (finish reason "error"). It counts as waiting (limits.Admission) from its
    admission until its first token or its end.
    """

    def __init__(
        self,
        engine: EngineLoop,
        metrics: ServerMetrics,
        fanout: Fanout,
        admission: Admission | None = None,
        timeout_s: float | None = None,
        live: set[Generation] | None = None,
    ) -> None:
        self.engine, self.metrics, self.fanout = engine, metrics, fanout
        self.prompts, self.params = fanout.prompts, fanout.params
        self.admission, self.timeout_s = admission, timeout_s
        self.live = live if live is not None else set()
        self.ids = [f"{uuid.uuid4().hex}-{i}" for i in range(len(self.prompts))]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.open: set[int] = set()
        self.waiting: set[int] = set()  # admitted, no token yet
        self.outputs: list[SequenceOutput | None] = [None] * len(self.prompts)
        self.arrived_at = time.monotonic()
        self.submitted_at = 0.0
        self.last_token_at: list[float | None] = [None] * len(self.prompts)
        self.first_token_at: dict[int, float] = {}  # the frontend's clock, per choice
        self.on_finish: Callable[[str], None] | None = None  # called once, with a summary

    async def start(self) -> None:
        """Submit every request; if any is refused, drop the others and raise APIError."""
        if self.admission is not None:
            self.admission.admit(self.prompts)
            self.waiting = set(range(len(self.prompts)))
        self.live.add(self)
        self.submitted_at = time.monotonic()
        futures = [
            self.engine.submit(rid, prompt, params, asyncio_deliver(self.queue, i))
            for i, (rid, prompt, params) in enumerate(zip(self.ids, self.prompts, self.params))
        ]
        self.open = set(range(len(futures)))
        errors = []
        for future in futures:
            try:
                await asyncio.wrap_future(future)
            except Exception as e:
                errors.append(e)
        if errors:
            self._drop()
            self.close()
            if isinstance(errors[0], RequestError):
                raise bad_request(str(errors[0]))
            raise APIError(503, public_message(str(errors[0])), rejected="unavailable")
        self.metrics.prompt_tokens(sum(len(p) for p in self.prompts))

    def _drop(self) -> None:
        """Abort the engine requests still open without counting them (they never ran)."""
        for index in self.open:
            self.engine.abort(self.ids[index])
        self.open.clear()

    def abort(self) -> int:
        """Abort the engine requests still running, counted as aborted; returns how many."""
        now = time.monotonic()
        aborted = len(self.open)
        for index in self.open:
            self.engine.abort(self.ids[index])
            self.metrics.finished("abort", now - self.arrived_at)
        if aborted:
            self.metrics.aborted.inc(aborted)
        self.open.clear()
        return aborted

    def close(self) -> None:
        """The HTTP request is over: whatever still counted as waiting stops counting."""
        self.live.discard(self)
        for index in self.waiting:
            self._started(index)
        self.waiting = set()

    def _started(self, index: int) -> None:
        if self.admission is not None:
            self.admission.started(len(self.prompts[index]))

    async def watch_disconnect(self, receive: Callable) -> None:
        """Run beside the response: when the client goes away, abort and end `events()`."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self.abort()
        self.queue.put_nowait((-1, CLIENT_GONE))

    async def _next(self) -> tuple[int, object]:
        if self.timeout_s is None:
            return await self.queue.get()
        left = self.arrived_at + self.timeout_s - time.monotonic()
        try:
            return await asyncio.wait_for(self.queue.get(), max(left, 0.0))
        except TimeoutError:
            self.abort()
            message = f"request timed out after {self.timeout_s:g} s (the server's limit)"
            raise APIError(504, message, code="timeout") from None

    async def events(self) -> AsyncIterator[tuple[int, SequenceOutput]]:
        """(choice index, output) until every request finished or the client went away."""
        while self.open:
            index, item = await self._next()
            if item is CLIENT_GONE:
                return
            if isinstance(item, EngineFailure):
                now = time.monotonic()
                for _ in self.open:
                    self.metrics.finished("error", now - self.arrived_at)
                self._drop()
                raise APIError(item.status, item.message)
            assert isinstance(item, SequenceOutput)
            self._observe(index, item)
            yield index, item

    def _observe(self, index: int, out: SequenceOutput) -> None:
        now = time.monotonic()
        if self.outputs[index] is None and out.queue_time is not None:
            self.metrics.queued(out.queue_time)
        self.outputs[index] = out
        if index in self.waiting and (out.new_token_ids or out.finished):
            self.waiting.discard(index)
            self._started(index)
        if out.new_token_ids:
            self.metrics.generation_tokens(len(out.new_token_ids))
            last = self.last_token_at[index]
            if last is None:
                self.metrics.first_token(now - self.submitted_at)
                self.first_token_at[index] = now
            else:  # tokens that arrive together share the interval since the previous ones
                for _ in out.new_token_ids:
                    self.metrics.inter_token((now - last) / len(out.new_token_ids))
            self.last_token_at[index] = now
        if out.finished:
            self.open.discard(index)
            self.metrics.finished(out.finish_reason, now - self.arrived_at)
            self._phases(index, out, now)
            if not self.open and self.on_finish is not None:
                self.on_finish(self.summary(now))

    def _phases(self, index: int, out: SequenceOutput, now: float) -> None:
        """vLLM's per-request histograms: sizes, prefill (the rank's clock) and decode."""
        prefill = None
        if out.first_token_time is not None and out.first_scheduled_time is not None:
            prefill = out.first_token_time - out.first_scheduled_time
        first = self.first_token_at.get(index)
        self.metrics.request_done(len(out.prompt_token_ids), len(out.token_ids),
                                  self.fanout.params[index].max_tokens, prefill,
                                  None if first is None else now - first)  # fmt: skip

    def summary(self, now: float) -> str:
        reasons = ",".join(str(o.finish_reason) for o in self.outputs if o is not None)
        tokens = sum(len(o.token_ids) for o in self.outputs if o is not None)
        return f"{tokens} tokens in {now - self.arrived_at:.3f} s ({reasons})"

    async def collect(self, receive: Callable) -> list[SequenceOutput] | None:
        """Every final output in choice order, or None when the client went away first."""
        watcher = asyncio.ensure_future(self.watch_disconnect(receive))
        try:
            async for _ in self.events():
                pass
        finally:
            watcher.cancel()
            self.abort()
            self.close()
        if any(out is None or not out.finished for out in self.outputs):
            return None
        return list(self.outputs)  # type: ignore[arg-type]

    def usage(self) -> dict[str, Any]:
        # Like OpenAI: a prompt counts once however many choices it has; every candidate's
        # tokens count, best_of's unreturned ones included. Cached tokens: each prompt's first
        # candidate's, as its prompt tokens are counted once.
        step = self.fanout.candidates
        prompt = sum(len(p) for p in self.prompts[::step])
        completion = sum(len(out.token_ids) for out in self.outputs if out is not None)
        firsts = self.outputs[::step]
        cached = sum(out.num_cached_tokens or 0 for out in firsts if out is not None)
        return usage(prompt, completion, cached)
