"""The frontend's core client of a multi-process world: routes each request to the attention rank
with the least outstanding work, gathers the ranks' token deltas, fails every request at once when
a rank dies or hangs, and stops the world; or, where failed worlds are restarted in place
(`STANDBY.enabled`: serve's on_engine_failure="restart"), keeps the surviving ranks for `repair`,
which replaces only the failed ones. The processes themselves are afd/ranks/world.py's
`RankWorld`; the routing policy is frontend/routing.py's.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from afdserve.afd.ranks.channel import Waker
from afdserve.afd.ranks.messages import (
    AbortRequest,
    AddRequest,
    Outputs,
    Parted,
    RankFailed,
    RankStats,
    Rejected,
    WorkerSpec,
)
from afdserve.afd.ranks.world import (
    STANDBY,
    STARTUP_TIMEOUT_S,
    Lost,
    RankWorld,
    WorkerError,
    free_port,
)
from afdserve.engine.device import resolve_device
from afdserve.engine.requests import RequestError, RequestLimits, TokenDelta, check_request
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.speculative import SpecStats
from afdserve.frontend.core_client import EngineCoreClient, EngineStats, cache_config_labels
from afdserve.frontend.routing import Router

__all__ = ["ProcessClient", "WorkerError", "free_port"]

log = logging.getLogger(__name__)

# A request weighs its prompt plus its token budget, capped: one request with a huge max_tokens
# must not send every other request to the other attention ranks.
ROUTING_MAX_NEW_TOKENS = 1024
# How long step() waits for a rank's outputs when none are in: short, so that the thread that
# steps (the server's engine loop) notices a failed rank and the stop signal within it while
# ranks compute; a new request or abort ends the wait at once (`wake`).
OUTPUT_WAIT_S = 0.005


def device_kind(spec: WorkerSpec) -> str:
    """ "cpu" or "cuda": where the world's ranks run."""
    return "cuda" if resolve_device(spec.engine.device).startswith("cuda") else "cpu"


class ProcessClient(EngineCoreClient):
    def __init__(
        self,
        spec: WorkerSpec,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        spawn: bool = True,
        frontend_address: tuple[str, int] = ("127.0.0.1", 0),
    ) -> None:
        self.spec = spec
        self.closed = False
        self.owner: dict[str, int] = {}  # request id -> attention rank
        self.cost: dict[str, int] = {}
        self.rank_stats: dict[int, RankStats] = {}
        self.iteration_tokens: Counter[int] = Counter()  # every rank's steps: tokens -> steps
        self._carried: list[TokenDelta] = []
        # rank -> the AddRequests and AbortRequests for it, in order, sent by the next step().
        self._outbox: dict[int, list[AddRequest | AbortRequest]] = {}
        self.world = RankWorld(spec, spawn, frontend_address, startup_timeout_s)
        self._waker = Waker()  # ends step()'s wait for outputs when a request is queued
        # A world whose failed ranks are replaced in place keeps its survivors when one fails:
        # gloo worlds only (CPU). A survivor of an NCCL world may sit in a collective with the
        # dead rank that only ncclCommAbort from another thread ends, and one of an "ipc" world
        # in a device-side wait on its peer's signal: such worlds restart whole, as before.
        self.repairable = spawn and STANDBY.enabled and device_kind(spec) == "cpu"
        if spawn and STANDBY.enabled and not self.repairable:
            log.info(
                "a failed rank of this %s world restarts the whole world (only gloo worlds, "
                "on CPU, are rebuilt around their surviving ranks)",
                device_kind(spec),
            )
        self.broken = False  # a rank failed: no step until `repair`
        self.address = self.world.address
        self._take_ready()

    def _take_ready(self) -> None:
        """Limits and routing from the world's RankReady messages (again after a repair: a
        replaced attention rank may have sized its KV cache differently)."""
        spec, self.ready = self.spec, self.world.ready
        limits = [info.limits for info in self.ready.values() if info.limits is not None]
        self.limits = RequestLimits(
            min(lim.max_model_len for lim in limits),
            limits[0].vocab_size,
            min(lim.num_blocks for lim in limits),
            limits[0].block_size,
            max(lim.slot_pages for lim in limits),
        )
        self.max_model_len, self.vocab_size = self.limits.max_model_len, self.limits.vocab_size
        attention = range(spec.topology.attention_ranks)
        self.router = Router(
            spec.afd.routing_policy,
            [self.ready[r].limits.num_blocks for r in attention],  # type: ignore[union-attr]
            self.limits.block_size,
            all(self.ready[r].prefix_caching for r in attention),
        )

        engine = spec.engine
        self.cache_config = cache_config_labels(
            self.limits, engine.kv_cache_dtype, all(self.ready[r].prefix_caching for r in attention)
        )

    @property
    def outstanding(self) -> list[int]:
        return self.router.outstanding

    # ----- EngineCoreClient -----
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        if self.broken:
            raise WorkerError("a rank failed: the world is being rebuilt")
        if request_id in self.owner:
            raise RequestError(f"request_id: {request_id!r} is already running")
        check_request(prompt_token_ids, params, self.limits)
        budget = min(params.max_tokens, ROUTING_MAX_NEW_TOKENS)
        rank, cost = self.router.route(prompt_token_ids, budget)
        self.owner[request_id], self.cost[request_id] = rank, cost
        message = AddRequest(request_id, tuple(prompt_token_ids), params, tuple(output_token_ids))
        self._outbox.setdefault(rank, []).append(message)

    def abort(self, request_id: str) -> None:
        rank = self.owner.get(request_id)
        if rank is not None and not self.broken:  # a broken world drops every request anyway
            self._outbox.setdefault(rank, []).append(AbortRequest(request_id))
            self._forget(request_id)

    def _flush(self) -> None:
        """Send what add_request and abort queued, one write per rank: a rank woken by a burst
        of requests (one generate() call, a server's queue) reads all of it before it schedules,
        and batches it. Every rank joins each control round, so the attention ranks that got
        nothing are nudged out of their idle wait too."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        for rank, messages in outbox.items():
            self.world.send_many(rank, messages)
        if any(isinstance(m, AddRequest) for messages in outbox.values() for m in messages):
            others = range(self.spec.topology.attention_ranks)
            self.world.nudge(r for r in others if r not in outbox)

    def _forget(self, request_id: str) -> None:
        rank = self.owner.pop(request_id, None)
        if rank is not None:
            self.router.release(rank, self.cost.pop(request_id))

    def step(self) -> list[TokenDelta]:
        if self.closed:
            raise WorkerError("the engine is shut down")
        if self.broken:
            raise WorkerError("a rank failed: the world is being rebuilt")
        self._flush()
        results, self._carried = self._carried, []
        rejected: RequestError | None = None
        for msg in self.world.messages(0.0 if results else OUTPUT_WAIT_S, self._waker):
            if isinstance(msg, Outputs):
                self.rank_stats[msg.rank] = msg.stats
                self.iteration_tokens.update(msg.stats.step_tokens)
                for delta in msg.outputs:
                    if delta.request_id not in self.owner:
                        continue  # aborted meanwhile (a stop string, found by the frontend)
                    results.append(delta)
                    if delta.finished:
                        self._forget(delta.request_id)
            elif isinstance(msg, Rejected):  # a rank refused what passed the frontend's checks
                self._forget(msg.request_id)
                rejected = RequestError(msg.message, msg.request_id)
            elif isinstance(msg, (RankFailed, Lost, Parted)):
                detail = (
                    msg.traceback
                    if isinstance(msg, RankFailed)
                    else msg.reason
                    if isinstance(msg, Parted)
                    else "connection lost"
                )
                failed = sorted(self.world.failed_ranks())
                self._fail()
                if isinstance(msg, Parted) and failed:  # name the cause, not the witness
                    raise WorkerError(
                        f"rank(s) {failed} failed (rank {msg.rank} left its world:\n{detail})"
                    )
                raise WorkerError(f"rank {msg.rank} failed:\n{detail}")
        if rejected is not None:
            self._carried = results  # handed out by the next step()
            raise rejected
        try:
            if not results:
                self.world.check_alive("while serving")
            # Also while other ranks deliver: one silent rank is stuck whatever the rest do.
            self.world.check_progress(self.spec.afd.heartbeat_timeout_s)
        except WorkerError:
            self._fail()
            raise
        return results

    @property
    def has_unfinished(self) -> bool:
        return bool(self.owner)

    def stats(self) -> EngineStats:
        stats = EngineStats()
        ranks = max(len(self.outstanding), 1)
        for rank, rank_stats in self.rank_stats.items():
            if rank_stats.role == "ffn":
                stats.ffn_forward_s[rank] = rank_stats.forward_s
                stats.ffn_wait_s[rank] = rank_stats.wait_s
                stats.ffn_tokens[rank] = rank_stats.scheduled_tokens
                continue
            stats.prefix_cache_queries[rank] = rank_stats.prefix_cache_queries
            stats.prefix_cache_hits[rank] = rank_stats.prefix_cache_hits
            if rank_stats.spec_decode is not None:
                drafts, drafted, accepted, *per_pos = rank_stats.spec_decode
                stats.spec_decode[rank] = SpecStats(drafts, drafted, accepted, per_pos)
            stats.running += rank_stats.running
            stats.waiting += rank_stats.waiting
            stats.kv_cache_usage += rank_stats.kv_cache_usage / ranks
            for mode, count in rank_stats.steps.items():
                stats.steps[mode] = stats.steps.get(mode, 0) + count
            stats.preemptions[rank] = rank_stats.preemptions
            stats.scheduled_tokens[rank] = rank_stats.scheduled_tokens
            stats.forward_s[rank] = rank_stats.forward_s
            stats.wait_s[rank] = rank_stats.wait_s
            stats.a2e_bytes[rank] = rank_stats.a2e_bytes
            stats.e2a_bytes[rank] = rank_stats.e2a_bytes
        stats.iteration_tokens = dict(self.iteration_tokens)
        stats.cache_config = self.cache_config
        return stats

    def _fail(self) -> None:
        """A rank died or hangs: the world cannot step again. Kill it now rather than wait for
        ranks that may never answer a shutdown; a repairable world kills only the failed ranks
        (which unblocks the survivors waiting on them) and waits for `repair`."""
        if self.repairable:
            self.broken = True
            self.world.kill_failed()
            return
        self.world.kill()
        self.shutdown()

    def repair(self) -> bool:
        """Rebuild the broken world around its surviving ranks (RankWorld.rebuild): only the
        failed ranks are replaced and load weights. Every request is dropped: the caller resumes
        them by recompute. False (the world is shut down) when it cannot be rebuilt."""
        if not self.broken or self.closed:
            return False
        began = time.monotonic()
        try:
            replaced = self.world.rebuild()
        except WorkerError as e:
            first = (str(e).splitlines() or [""])[0]
            log.warning(
                "could not rebuild the world around its surviving ranks (%s): every rank restarts",
                first,
            )
            self.world.kill()
            self.shutdown()
            return False
        self.broken = False
        self.owner.clear()
        self.cost.clear()
        self._carried = []
        self._outbox.clear()  # for the world that failed
        self._take_ready()
        log.info(
            "world rebuilt in %.1f s: rank(s) %s replaced, the others kept their weights",
            time.monotonic() - began,
            sorted(replaced),
        )
        try:  # the next standby world, for the next failure
            STANDBY.replenish(self.world.world)
        except OSError:
            log.warning("could not start standby rank processes", exc_info=True)
        return True

    def wake(self) -> None:
        self._waker.wake()

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.world.shutdown()
            self._waker.close()
