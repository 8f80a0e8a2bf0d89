"""The one thread that owns the EngineClient (which is not thread-safe), and `Generation`, a
handler's asyncio-side view of the engine requests it started.

HTTP handlers never touch the client: they put commands on a thread-safe queue and receive each
SequenceOutput of their request through a `Deliver` callback, which hands it to their asyncio loop.
The thread alternates: apply queued adds and aborts, then `client.step()`.

If `step()` raises anything but a per-request refusal, a rank is gone and `error` says why
(serve.py then exits or restarts the ranks). Without `Recovery.resume` every in-flight request is
failed with an EngineFailure, new ones are refused, and `healthy` turns False for good. With it
(on_engine_failure="restart") the loop keeps every request, takes new ones, and waits for
`resume_on(new client)`: each request goes on from its prompt plus the tokens it already had
(recomputed; the seeded sampler skips their draws), so its client sees a pause and then the
tokens an undisturbed run gives. Clients see an error's first line; the log keeps all of it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from afdserve.engine.requests import RequestError
from afdserve.engine.sampling_params import SamplingParams
from afdserve.frontend.client import EngineClient, EngineStats
from afdserve.frontend.output_processor import Progress
from afdserve.frontend.outputs import SequenceOutput
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


@dataclass(frozen=True)
class Resumed:
    """Delivered when a request goes on, on a new engine, after the one it ran on failed."""

    seconds_lost: float  # from the failure to the new engine taking the request back


Deliver = Callable[[SequenceOutput | EngineFailure | Resumed], None]


class AsyncioDeliver:
    """A Deliver that puts `(tag, item)` on an asyncio queue from any thread. Make it inside
    the event loop. `deliver_all` hands a step's items for one loop over in one call."""

    def __init__(self, q: asyncio.Queue, tag: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue, self.tag = q, tag

    def __call__(self, item: SequenceOutput | EngineFailure | Resumed) -> None:
        _call_in(self.loop, _put_all, [(self.queue, (self.tag, item))])


def asyncio_deliver(q: asyncio.Queue, tag: int) -> Deliver:
    return AsyncioDeliver(q, tag)


def deliver_all(items: list[tuple[Deliver, SequenceOutput]]) -> None:
    """Deliver a step's outputs in order: one wake-up per event loop for all of its requests
    rather than one per request, which keeps the engine thread's share of a step (and of the
    interpreter lock) small at hundreds of streams."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, tuple]]] = {}
    for deliver, item in items:
        if isinstance(deliver, AsyncioDeliver):
            by_loop.setdefault(deliver.loop, []).append((deliver.queue, (deliver.tag, item)))
        else:
            deliver(item)
    for loop, puts in by_loop.items():
        _call_in(loop, _put_all, puts)


def _call_in(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _put_all(puts: list[tuple[asyncio.Queue, tuple]]) -> None:
    for q, entry in puts:
        q.put_nowait(entry)


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


@dataclass(frozen=True)
class _Attach:
    client: EngineClient  # the restarted engine: resume the requests on it


@dataclass
class _Flight:
    """A request the loop answers for, from its acceptance to its end."""

    prompt: list[int]
    params: SamplingParams
    deliver: Deliver
    on_engine: bool = False  # added to the current client (False while the engine is down)
    resumes: int = 0
    progress: Progress | None = None  # its output when its engine failed: resumed from there
    failed_at: float | None = None  # when the outage it waits out began


@dataclass(frozen=True)
class Recovery:
    """What a loop does when its engine fails. `resume`: hold every request (those in flight and
    those arriving) until `EngineLoop.resume_on` hands it a new client, then go on with each from
    its prompt and the tokens it already had; a request whose engine failed under it more than
    `max_resumes` times fails instead. Without `resume` every request fails at once."""

    resume: bool = False
    max_resumes: int = 0
    on_resume: Callable[[], None] = lambda: None  # once per request resumed
    on_recovered: Callable[[float], None] = lambda seconds: None  # seconds without an engine


class EngineLoop:
    def __init__(
        self,
        client: EngineClient,
        idle_wait_s: float = IDLE_WAIT_S,
        recovery: Recovery = Recovery(),
    ) -> None:
        self.client = client
        self.idle_wait_s = idle_wait_s
        self.recovery = recovery
        self.error: str | None = None
        self._commands: queue.SimpleQueue[_Add | _Abort | _Attach | None] = queue.SimpleQueue()
        self._backlog: deque[_Add | _Abort | _Attach | None] = deque()  # left by a failed batch
        self._flights: dict[str, _Flight] = {}  # owned by the engine thread
        self._outage_since: float | None = None
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

    @property
    def holds_requests(self) -> bool:
        """Takes requests while its engine is down, to run them once resume_on gives one."""
        return self.recovery.resume and not self._closed and self._thread.is_alive()

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
                self.client.wake()  # the thread may be waiting on the ranks' outputs
        return accepted

    def abort(self, request_id: str) -> None:
        with self._lock:
            if not self._closed:
                self._commands.put(_Abort(request_id))
                self.client.wake()

    def resume_on(self, client: EngineClient) -> None:
        """The engine was restarted: go on with every request held since it failed. The error
        is cleared here, at once, so that whoever watches it does not restart again."""
        with self._lock:
            if self._closed:
                raise RuntimeError(self.error or "the engine loop has stopped")
            self.error = None
            self._commands.put(_Attach(client))

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the thread and fail whatever is in flight; the client itself stays open."""
        self._stop.set()
        self._commands.put(None)
        self.client.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ----- the engine thread -----
    def _run(self) -> None:
        client: EngineClient | None = None  # a restarted engine to resume the requests on
        try:
            while True:
                try:
                    if client is not None:
                        self._resume(client)
                    self._serve()
                    return
                except Exception as e:  # a rank died or the client broke
                    log.exception("engine loop failed")
                    self.error = f"engine failed: {public_message(f'{type(e).__name__}: {e}')}"
                    if not self.recovery.resume:
                        return  # nothing can finish now
                self._suspend()
                client = self._wait_for_engine()
                if client is None:
                    return
        finally:
            self._close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._apply(self._next_commands())
            if self._stop.is_set():
                break
            self._step()

    def _next_commands(self) -> list[_Add | _Abort | _Attach | None]:
        commands = list(self._backlog)
        self._backlog.clear()
        if not commands and not self.client.has_unfinished and not self._flights:
            try:  # idle: sleep on the queue so a new request wakes us at once
                commands.append(self._commands.get(timeout=self.idle_wait_s))
            except queue.Empty:
                pass
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[_Add | _Abort | _Attach | None]) -> None:
        for i, cmd in enumerate(commands):
            try:
                self._apply_one(cmd)
            except Exception:
                self._backlog.extend(commands[i + 1 :])  # the outage takes them over
                raise

    def _apply_one(self, cmd: _Add | _Abort | _Attach | None) -> None:
        if isinstance(cmd, _Add):
            flight = _Flight(cmd.prompt, cmd.params, cmd.deliver)
            try:
                self.client.add_request(cmd.request_id, cmd.prompt, cmd.params)
            except RequestError as e:
                cmd.accepted.set_exception(e)
                return
            except Exception as e:
                if self.recovery.resume:  # it waits for the restarted engine like the others
                    self._flights[cmd.request_id] = flight
                    cmd.accepted.set_result(None)
                else:
                    message = f"engine failed: {public_message(str(e))}"
                    cmd.accepted.set_exception(RuntimeError(message))
                raise
            flight.on_engine = True
            self._flights[cmd.request_id] = flight
            cmd.accepted.set_result(None)
        elif isinstance(cmd, _Abort) and self._flights.pop(cmd.request_id, None) is not None:
            self.client.abort(cmd.request_id)
        elif isinstance(cmd, _Attach):
            log.warning("a restarted engine was handed to a loop whose engine had not failed")

    def _step(self) -> None:
        try:
            outputs = self.client.step()
        except RequestError as e:
            # A rank refused a request the frontend's checks let through. Fail that request when
            # the error says which one; the engine itself is fine.
            request_id = getattr(e, "request_id", None)
            flight = self._flights.pop(request_id, None) if request_id else None
            if flight is not None:
                flight.deliver(EngineFailure(str(e), status=400))
            else:
                log.warning("engine refused a request: %s", e)
            return
        deliveries = []
        for out in outputs:
            flight = self._flights.get(out.request_id)
            if flight is None:
                continue  # aborted meanwhile
            if out.finished:
                del self._flights[out.request_id]
            deliveries.append((flight.deliver, out))
        deliver_all(deliveries)
        self._stats = self.client.stats()

    # ----- an outage (Recovery.resume) -----
    def _suspend(self) -> None:
        """The engine failed: keep each request's output so far; fail those resumed too often."""
        now = time.monotonic()
        if self._outage_since is None:
            self._outage_since = now
        limit = self.recovery.max_resumes
        for request_id, flight in list(self._flights.items()):
            progress = self.client.take_progress(request_id)
            if progress is not None:  # None: it had not reached the engine, keep what we had
                flight.progress = progress
            if flight.failed_at is None:
                flight.failed_at = now
            if not flight.on_engine:
                continue
            flight.on_engine = False
            if flight.resumes >= limit:
                del self._flights[request_id]
                message = (
                    f"{self.error}; this request is not resumed again: its engine failed "
                    f"{flight.resumes + 1} time(s) under it (max_request_resumes={limit})"
                )
                flight.deliver(EngineFailure(message))
        log.warning("engine down: %d request(s) wait for its restart", len(self._flights))

    def _wait_for_engine(self) -> EngineClient | None:
        """Hold new requests and apply aborts until a new client arrives (None: stop)."""
        while True:
            cmd = self._backlog.popleft() if self._backlog else self._commands.get()
            if cmd is None or self._stop.is_set():
                return None
            if isinstance(cmd, _Attach):
                return cmd.client
            if isinstance(cmd, _Add):
                flight = _Flight(cmd.prompt, cmd.params, cmd.deliver, failed_at=time.monotonic())
                self._flights[cmd.request_id] = flight
                cmd.accepted.set_result(None)
            elif isinstance(cmd, _Abort):
                self._flights.pop(cmd.request_id, None)

    def _resume(self, client: EngineClient) -> None:
        """Hand every held request to the new client, in arrival order. Raises when the new
        engine fails on the way (the next outage takes over the requests not yet on it)."""
        self.client = client
        now = time.monotonic()
        resumed = 0
        for request_id, flight in list(self._flights.items()):
            try:
                if flight.progress is not None:
                    client.resume_request(request_id, flight.params, flight.progress)
                else:
                    client.add_request(request_id, flight.prompt, flight.params)
            except RequestError as e:
                del self._flights[request_id]
                flight.deliver(EngineFailure(str(e), status=400))
                continue
            flight.on_engine = True
            if flight.progress is not None or flight.resumes:
                flight.resumes += 1
                resumed += 1
                self.recovery.on_resume()
                flight.deliver(Resumed(now - (flight.failed_at or now)))
            flight.failed_at = None
        if self._outage_since is not None:
            self.recovery.on_recovered(now - self._outage_since)
            self._outage_since = None
        log.info("engine back: %d request(s) resumed, %d in all", resumed, len(self._flights))

    def _close(self) -> None:
        with self._lock:
            self._closed = True
        message = self.error or "the server is shutting down"
        failure = EngineFailure(message, status=500 if self.error else 503)
        for flight in self._flights.values():
            flight.deliver(failure)
        if self.error is None:
            for request_id in self._flights:
                try:
                    self.client.abort(request_id)
                except Exception:  # shutting down anyway; the client is closed next
                    log.debug("abort of %s during shutdown failed", request_id, exc_info=True)
        self._flights.clear()
        pending = list(self._backlog)
        while True:
            try:
                pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for cmd in pending:
            if isinstance(cmd, _Add) and not cmd.accepted.done():
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
        self.resumes = 0  # engine requests resumed after an engine failure, all counted
        self.seconds_lost = 0.0  # their seconds without an engine, summed

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
            message, retry = public_message(str(errors[0])), self._retry_after()
            raise APIError(503, message, headers=retry, rejected="unavailable")
        self.metrics.prompt_tokens(sum(len(p) for p in self.prompts))

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.admission.retry_after_s if self.admission else 1)}

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
            if isinstance(item, Resumed):
                self.resumes += 1
                self.seconds_lost += item.seconds_lost
                continue
            if isinstance(item, EngineFailure):
                now = time.monotonic()
                for _ in self.open:
                    self.metrics.finished("error", now - self.arrived_at)
                self._drop()
                retry = self._retry_after() if item.status == 503 else None
                raise APIError(item.status, item.message, headers=retry)
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
        self.metrics.request_done(
            len(out.prompt_token_ids),
            len(out.token_ids),
            self.fanout.params[index].max_tokens,
            prefill,
            None if first is None else now - first,
        )

    def summary(self, now: float) -> str:
        reasons = ",".join(str(o.finish_reason) for o in self.outputs if o is not None)
        tokens = sum(len(o.token_ids) for o in self.outputs if o is not None)
        summary = f"{tokens} tokens in {now - self.arrived_at:.3f} s ({reasons})"
        if self.resumes:
            lost = f"{self.seconds_lost:.3f} s lost"
            summary += f", resumed {self.resumes} time(s) after engine failures, {lost}"
        return summary

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
