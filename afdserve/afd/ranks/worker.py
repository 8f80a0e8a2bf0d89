"""Rank processes: one per rank, joined in one torch.distributed world through env://.

A rank connects to the frontend, receives its WorkerSpec, builds itself (afd/ranks/build.py), warms
up in lockstep with every other rank, reports ready, and then steps its role's driver until the
control plane carries shutdown. Attention ranks also apply the frontend's requests between steps
and send their outputs back. A rank whose world breaks under it keeps its half and rejoins the
next world generation (`worker_main`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from afdserve.afd.ranks.build import BuiltRank, build_attention_rank, build_ffn_rank
from afdserve.afd.ranks.channel import Channel, ChannelError, connect, read_key
from afdserve.afd.ranks.messages import (
    AbortRequest,
    AddRequest,
    Hello,
    Nudge,
    Outputs,
    Parted,
    RankFailed,
    RankStats,
    Rejected,
    Rejoin,
    Shutdown,
    WorkerSpec,
)
from afdserve.afd.ranks.sender import OutputSender
from afdserve.afd.step.control import open_control_plane
from afdserve.engine.device import resolve_device
from afdserve.engine.log_format import LOG_FORMAT_ENV, JsonLines
from afdserve.engine.requests import RequestError

log = logging.getLogger(__name__)

# Idle ranks back off from 1 ms to 20 ms between control rounds, so that idle worlds do not keep
# every core busy; an attention rank waits on its frontend channel meanwhile, so a request
# addressed to it starts the next round as soon as it arrives, not after the backoff.
IDLE_SLEEP_S = (0.001, 0.020)
CONNECT_TIMEOUT_S = 300.0
# An attention rank reports at least this often, also when idle: the frontend's proof of
# progress (AFDConfig.heartbeat_timeout_s).
HEARTBEAT_S = 0.5


def rank_device(spec: WorkerSpec, rank: int) -> torch.device:
    if resolve_device(spec.engine.device).startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", rank))
        return torch.device("cuda", local % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def spawned_by_frontend() -> bool:
    """The built-in launcher started this rank, and every rank of its world, on this host."""
    return "AFDSERVE_STORE_PATH" in os.environ


def _store(world: int, timeout: timedelta, path: str | None) -> dist.Store | None:
    """The rendezvous store. The built-in launcher names a file in a directory of its user's
    alone (AFDSERVE_STORE_PATH, or the WorkerSpec's / Rejoin's `store_path` for a later world
    generation): a FileStore there has no socket for another process to reach, and the
    directory's mode keeps other users out (torch's TCPStore authenticates nobody, on loopback
    too). Worlds started by torchrun or Slurm rendezvous through env:// as usual."""
    if not spawned_by_frontend():
        return None
    store = dist.FileStore(path or os.environ["AFDSERVE_STORE_PATH"], world)
    store.set_timeout(timeout)
    return store


def init_world(
    spec: WorkerSpec, rank: int, store_path: str | None = None
) -> tuple[dist.ProcessGroup, torch.device]:
    """The data-plane world (NCCL on CUDA, gloo on CPU) and the control plane's gloo group."""
    device = rank_device(spec, rank)
    timeout = timedelta(seconds=spec.afd.timeout_s)
    world = spec.topology.world_size
    store = _store(world, timeout, store_path or spec.store_path)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl", rank=rank, world_size=world, timeout=timeout, device_id=device, store=store
        )
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout, store=store)
    return dist.new_group(backend="gloo", timeout=timeout), device


def init_expert_group(spec: WorkerSpec) -> dist.ProcessGroup | None:
    """The FFN ranks' own group for expert-parallel collectives (the data-plane backend). Every
    rank of the world takes part in creating it, as torch.distributed requires; a group of
    its own keeps the collectives apart from the point-to-point batches NCCL pairs one to one."""
    ranks = spec.topology.ffn_group
    if not ranks:
        return None
    return dist.new_group(ranks=list(ranks), timeout=timedelta(seconds=spec.afd.timeout_s))


def name_process(name: str) -> None:
    """Linux: the name ps, top and /proc/PID/comm show (15 bytes), so that a rank of a running
    world can be told from a standby process, which keeps the interpreter's name."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass  # not Linux: nothing shows the name anyway


def worker_main(rank: int, conn: Channel) -> None:
    """Entry point of one rank. MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK come from the
    environment (the launcher or torchrun sets them).

    A rank serves one world generation after another: when its world breaks while it serves (a
    peer died or was killed for hanging: a gloo operation or a control round fails), it drops
    everything tied to that world, keeps its half (and an attention rank its KV cache), says
    `Parted`, and joins the next generation when the frontend sends `Rejoin`. A failure before
    its first RankReady is `RankFailed`: nothing worth keeping was built."""
    conn.send(Hello(rank))
    spec = conn.recv()  # a standby process (world.Standby) waits here until its world starts
    if not isinstance(spec, WorkerSpec):
        raise TypeError(f"rank {rank}: expected a WorkerSpec first, got {type(spec).__name__}")
    name_process(f"afdserve-rank{rank}")
    logging.basicConfig(level=logging.INFO, format=f"[afdserve rank {rank}] %(message)s")
    if os.environ.get(LOG_FORMAT_ENV) == "json":  # the frontend's --log-format
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonLines(rank=rank))
        logging.captureWarnings(True)
    torch.set_num_threads(spec.threads)
    kept: BuiltRank | None = None
    loads, generation, store_path = 0, spec.generation, spec.store_path
    while True:
        built = control = None
        try:
            control_group, device = init_world(spec, rank, store_path)
            expert_group = init_expert_group(spec)
            control = open_control_plane(
                spec.afd.control_plane,
                spec.topology,
                control_group,
                rank,
                spec.afd.timeout_s,
                one_host=spawned_by_frontend(),
            )
            if kept is None:
                loads += 1
                log.info("loading weights (load %d of this process)", loads)
            if spec.topology.is_attention(rank):
                built = build_attention_rank(spec, rank, device, control, kept=kept)
            else:
                built = build_ffn_rank(spec, rank, device, control, expert_group, kept=kept)
            kept = built
            built.driver.warmup()  # the frontend logs each rank's memory line from its RankReady
            conn.send(dataclasses.replace(built.ready[0], generation=generation, loads=loads))
            if built.core is not None:
                serve_attention(built, rank, conn)
            else:
                serve_ffn(built, rank, conn)
            return
        except Exception:
            if kept is None:  # nothing to keep: this rank is replaced like a dead one
                _report_failure(rank, conn)
                raise
            reason = traceback.format_exc()
        except BaseException:
            _report_failure(rank, conn)
            raise
        finally:
            _leave_world(built, control)
        dropped = kept.drop_requests()
        log.warning(
            "world generation %d broke (%s); left it with %d request(s) dropped, "
            "keeping the weights; waiting to rejoin",
            generation,
            reason.strip().splitlines()[-1],
            dropped,
        )
        try:
            conn.send(Parted(rank, reason))
            rejoin = _wait_for_rejoin(rank, conn)
        except OSError:
            rejoin = None  # the frontend is gone
        if rejoin is None:
            # Ended with its world broken: the rank failed, and says so. A launcher that
            # restarts failed ranks (torchrun --max-restarts) starts it again, and it connects
            # to the frontend's next world; exit 0 would end torchrun's node as finished.
            log.warning("world generation %d broke and was not rebuilt: exiting 1", generation)
            raise SystemExit(1)
        generation, store_path = rejoin.generation, rejoin.store_path


def _report_failure(rank: int, conn: Channel) -> None:
    try:
        conn.send(RankFailed(rank, traceback.format_exc()))
    except OSError:
        pass


def _leave_world(built: BuiltRank | None, control) -> None:
    """Drop what ties this process to its world: the wire's log, the control board's mapping,
    and every process group (gloo closes its sockets, so peers still waiting on this rank fail
    at once instead of at the timeout)."""
    if built is not None and built.wire is not None:
        built.wire.close()
    if control is not None:
        control.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _wait_for_rejoin(rank: int, conn: Channel) -> Rejoin | None:
    """The frontend's answer to `Parted`: a Rejoin, or None for Shutdown (or a frontend gone).
    Requests and aborts queued before it belong to the broken generation: the frontend resumes
    them on the next one, so they are dropped here."""
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return None
        if isinstance(msg, Rejoin):
            return msg
        if isinstance(msg, Shutdown):
            return None
        if not isinstance(msg, (AddRequest, AbortRequest, Nudge)):
            raise TypeError(f"rank {rank}: unexpected message {type(msg).__name__}")


def _apply(built: BuiltRank, rank: int, conn: Channel) -> bool:
    """Apply queued frontend messages; True when shutdown was asked for (or the frontend left)."""
    while conn.poll():
        try:
            msg = conn.recv()
        except EOFError:
            return True
        if isinstance(msg, AddRequest):
            try:
                prompt = list(msg.prompt_token_ids)
                built.core.add_request(msg.request_id, prompt, msg.params, msg.output_token_ids)
            except RequestError as e:
                conn.send(Rejected(rank, msg.request_id, str(e)))
        elif isinstance(msg, AbortRequest):
            built.core.abort(msg.request_id)
        elif isinstance(msg, Shutdown):
            return True
        elif not isinstance(msg, Nudge):  # a nudge only ends the wait that read it
            raise TypeError(f"rank {rank}: unexpected message {type(msg).__name__}")
    return False


def _stats(built: BuiltRank) -> RankStats:
    scheduler, blocks = built.core.scheduler, built.core.block_manager
    meter = built.driver.meter
    a2e, e2a = boundary_bytes(built)
    clock = getattr(built.boundary, "clock", None)  # only a boundary over a wire waits
    return RankStats(
        scheduler.num_running,
        scheduler.num_waiting,
        blocks.usage,
        dict(built.driver.recorder.mode_counts),
        blocks.queried_tokens,
        blocks.hit_tokens,
        scheduler.num_preemptions,
        meter.drain(),
        meter.scheduled_tokens,
        meter.forward_s,
        0.0 if clock is None else clock.seconds,
        a2e,
        e2a,
        spec_decode=spec_counts(built.core.drafter),
    )


def spec_counts(drafter) -> tuple[int, ...] | None:
    """The drafter's counters as RankStats carries them (None without speculation)."""
    if drafter is None:
        return None
    s = drafter.stats
    return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, *s.accepted_per_pos)


def boundary_bytes(built: BuiltRank) -> tuple[int, int]:
    """Hidden-row bytes this rank sent to (A2E) and received from (E2A) its FFN rank, from the
    plans' tiles: every layer posts each ubatch's tile once. Ids and routing are not counted.
    (0, 0) when no wire is crossed (colocated, in-process 1A1F)."""
    boundary = built.boundary
    if getattr(boundary, "clock", None) is None:
        return 0, 0
    config = built.core.config
    rows = built.driver.meter.tile_rows * config.num_layers
    e2a_row = config.hidden_size * built.core.model.dtype.itemsize
    return rows * boundary.a2e.row_bytes(config.hidden_size), rows * e2a_row


def serve_attention(built: BuiltRank, rank: int, conn: Channel) -> None:
    """Step until shutdown. Each step's outputs leave from the sender's thread (sender.py), so
    their encoding overlaps the next step; all of them are sent before this returns or raises
    (and so before a `Parted` or `RankFailed`)."""
    sender = OutputSender(conn)
    try:
        _step_until_shutdown(built, rank, conn, sender)
    finally:
        sender.close()
    sender.check()


def _step_until_shutdown(built: BuiltRank, rank: int, conn: Channel, sender: OutputSender) -> None:
    idle_sleep = IDLE_SLEEP_S[0]
    last_sent = time.monotonic()
    while True:
        result = built.driver.step(shutdown=_apply(built, rank, conn))
        if result.shutdown:
            return
        if result.outputs or time.monotonic() - last_sent > HEARTBEAT_S:
            sender.send(Outputs(rank, tuple(result.outputs), _stats(built)))
            last_sent = time.monotonic()
        if result.has_work:
            idle_sleep = IDLE_SLEEP_S[0]
        elif conn.poll(idle_sleep):  # a message: the next round applies it at once
            idle_sleep = IDLE_SLEEP_S[0]
        else:
            idle_sleep = min(idle_sleep * 2, IDLE_SLEEP_S[1])


def serve_ffn(built: BuiltRank, rank: int, conn: Channel) -> None:
    """Step until shutdown; every HEARTBEAT_S an Outputs with no outputs carries this FFN rank's
    step figures to the frontend (the control plane decides everything else)."""
    last_sent = time.monotonic()
    meter, clock = built.driver.meter, built.driver.runner.exchange.transport.clock
    while not built.driver.step().shutdown:
        if time.monotonic() - last_sent > HEARTBEAT_S:
            stats = RankStats(
                scheduled_tokens=meter.scheduled_tokens,
                forward_s=meter.forward_s,
                wait_s=clock.seconds,
                role="ffn",
            )
            conn.send(Outputs(rank, (), stats))
            last_sent = time.monotonic()


def connect_to_frontend(
    address: tuple[str, int], authkey: bytes, deadline: float, parent: int | None = None
) -> Channel:
    """The rank's channel to the frontend, retried until `deadline` while the network says no:
    under torchrun a rank may start before the frontend listens (refused), and a frontend host
    under load may reset or time out a connection. A failed handshake (ChannelError: the keys
    differ) is not retried. `parent`: the pid of the frontend that spawned this rank; once this
    process has another parent the frontend is gone (killed before the rank connected), and the
    rank stops rather than retrying for the rest of `deadline` with its memory held."""
    while True:
        try:
            return connect(address, authkey)
        except ChannelError:  # a ConnectionError too, but no retry will change the keys
            raise
        except (ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            if parent is not None and os.getppid() != parent:
                raise ConnectionError(
                    f"the frontend that spawned this rank (pid {parent}) is gone; nothing "
                    f"listens at {address[0]}:{address[1]}"
                ) from None
            time.sleep(0.5)


def main() -> None:
    """`python -m afdserve.afd.ranks.worker`: one rank, under the launcher or torchrun.
    AFDSERVE_FRONTEND=host:port says where the frontend listens; the key comes from
    AFDSERVE_AUTHKEY (hex) or AFDSERVE_AUTHKEY_FILE (channel.read_key)."""
    parent = None
    if spawned_by_frontend():
        # Spawned by the built-in launcher: the frontend owns this process's life (it drains,
        # then sends Shutdown, and SIGKILLs what is left). A SIGINT or SIGTERM sent to the whole
        # process group (a terminal's Ctrl-C, a supervisor stopping the service) must not kill
        # the rank under requests the frontend is still draining.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # From the launcher, not getppid(): a frontend killed while this rank still imports
        # would already have left it to another parent.
        parent = int(os.environ.get("AFDSERVE_FRONTEND_PID", os.getppid()))
    host, port = os.environ["AFDSERVE_FRONTEND"].rsplit(":", 1)
    authkey = read_key()
    if authkey is None:
        sys.exit(
            "afdserve rank: set AFDSERVE_AUTHKEY (hex) or AFDSERVE_AUTHKEY_FILE to the "
            "frontend's key (its log says where it is)"
        )
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    try:
        conn = connect_to_frontend((host, int(port)), authkey, deadline, parent)
    except (ConnectionError, TimeoutError) as err:
        sys.exit(f"afdserve rank: cannot reach the frontend: {err}")
    try:
        worker_main(int(os.environ["RANK"]), conn)
    except BaseException:
        sys.exit(1)
    finally:
        conn.close()


if __name__ == "__main__":
    main()
