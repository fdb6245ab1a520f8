"""Ranks 1..N-1 of a tensor-parallel group, each in a process of its own (torch.multiprocessing, spawn), driven
by rank 0 (`Group`, held by rank 0's `TPDecoder`s).

Every rank lowers the package with its own `Sharder` (`rank_program`), then the ranks join one process group
(`Comm`). Rank 0 runs the engine: each call that changes a cache is sent to every worker over its pipe first,
then run by rank 0 itself (`Group.call`); the workers run the same call on their twin, so the collectives
inside the sharded program meet. Each worker answers every call (`ok` or the error), and rank 0 reads the
answers after its own part. A group runs decoders (`Twins`: a decoder per request, by the id rank 0 gave
it; `tp.decoder`) or one batched runner over a paged pool per rank (`Launch.runner`; `tp.runner`: the
worker's pool is as many pages as rank 0's, sent once every rank has loaded its weights).

Lifetime: `Group.stop` (the model closed, the group collected, the interpreter exiting: `weakref.finalize`)
sends `stop`, waits briefly, then terminates what is left; a worker whose pipe closes (rank 0 gone) exits. An
error that is not onnxgen's own (a collective failing, a worker dying) breaks the group: every worker is
stopped and later calls raise `BackendUnavailable`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

import onnxgen.envs as envs
from onnxgen.backends.native.device import int4_mode, torch_device
from onnxgen.backends.native.lowering import Program, lower
from onnxgen.backends.native.tp.comm import TIMEOUT_S, Comm
from onnxgen.backends.native.tp.shard import Sharder
from onnxgen.backends.native.tp.twins import RunnerTwin, Twins, check_batchable
from onnxgen.errors import BackendUnavailable, ContextOverflow, InvalidRequest, MissingRequiredInput

log = logging.getLogger(__name__)

# errors every rank raises alike before any collective (a request's own fault): the group goes on
BENIGN = (ContextOverflow, InvalidRequest, MissingRequiredInput)
STOP_WAIT_S = 10.0  # a worker's time to exit after `stop` before it is terminated


@dataclass(frozen=True)
class Launch:
    """What every rank builds its part from."""

    spec: Any
    device: str
    options: dict[str, Any]  # NativeDecoder's
    world: int
    store: str  # the FileStore's path
    runner: dict[str, Any] | None = None  # the paged runner's own arguments (None: decoders)


def rank_program(launch: Launch, rank: int, comm: Comm) -> tuple[Program, Any]:
    """Rank `rank`'s sharded program and its spec (its local heads: the KV cache it holds)."""
    sharder = Sharder(rank, launch.world, comm)
    dev = torch_device(launch.device) if rank == 0 or launch.device == "cpu" else torch.device("cuda", rank)
    prog = lower(
        launch.spec.decoder_path, launch.spec, dev, int4_mode(launch.options.get("int4")), shard=sharder
    )
    prog.info["tensor_parallel"] = {"rank": rank, "world": launch.world, **sharder.sharded}
    local = dataclasses.replace(launch.spec, num_heads=sharder.heads, num_kv_heads=sharder.kv_heads)
    return prog, local


class Group:
    """Rank 0's side of a tensor-parallel group: the worker processes, their pipes, the call protocol."""

    def __init__(self, launch: Launch, procs: list[Any], conns: list[Any], tmp: str) -> None:
        self.launch = launch
        self.world = launch.world
        self._procs, self._conns = procs, conns
        self.lock = threading.RLock()  # one call at a time across every decoder of the group
        self.broken: str | None = None
        self._next_id = 1
        self._dropped: list[int] = []
        self._finalizer = weakref.finalize(self, _stop, procs, conns, tmp)

    @staticmethod
    def start(
        spec: Any, device: str, options: dict[str, Any], world: int, runner: dict[str, Any] | None = None
    ) -> tuple[Group, Comm]:
        """Start ranks 1..world-1 and join them as rank 0 (after every rank lowered its program, so a graph
        that cannot be sharded is refused before anyone waits on the group). Returns the group and rank 0's
        `Comm` (connected; rank 0 lowers its own program with it before `connect`: see `TPDecoder.start`).
        `runner`: the workers run a paged runner each (`Launch.runner`), else decoders."""
        tmp = tempfile.mkdtemp(prefix="onnxgen-tp-")
        launch = Launch(spec, device, dict(options), world, os.path.join(tmp, "store"), runner)
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker_main, args=(rank, launch, child), daemon=True, name=f"onnxgen-tp{rank}"
            )
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        group = Group(launch, procs, conns, tmp)
        return group, Comm(0, world, torch_device(device))

    def wait(self, what: str) -> None:
        """Read one `what` message from every worker (start-up); a worker's error is raised here."""
        for rank, conn in enumerate(self._conns, start=1):
            kind, value = self._recv(rank, conn, TIMEOUT_S)
            if kind == "error":
                self.stop(f"worker {rank} failed while starting")
                _raise(value, rank)
            assert kind == what, (kind, what)

    def new_id(self) -> int:
        with self.lock:
            i = self._next_id
            self._next_id += 1
            return i

    def dropped(self, decoder_id: int) -> None:
        """A decoder of rank 0 was collected: its workers' twins go with the next call."""
        self._dropped.append(decoder_id)

    def send(self, *call: Any, per_rank: list[tuple[Any, ...]] | None = None) -> None:
        """Send `call` to every worker, or `per_rank[r - 1]` to worker r (the caller holds `lock` and then calls
        `answers`)."""
        if self.broken is not None:
            raise BackendUnavailable(f"the tensor-parallel workers have stopped: {self.broken}")
        drops, self._dropped = self._dropped, []
        try:
            for i, conn in enumerate(self._conns):
                for d in drops:
                    conn.send(("drop", d))
                conn.send(call if per_rank is None else per_rank[i])
        except OSError as exc:
            self.stop(f"a worker's pipe failed ({exc})")
            raise BackendUnavailable(f"the tensor-parallel workers have stopped: {self.broken}") from exc

    def call(
        self, call: tuple[Any, ...], mine: Callable[[], Any], per_rank: list[tuple[Any, ...]] | None = None
    ) -> tuple[Any, list[Any]]:
        """Send `call` (or `per_rank`, as `send`) to every worker, run rank 0's part `mine`, then read the
        answers: `(mine's result, the workers' results)`. Rank 0's failure stops the group unless `BENIGN`."""
        with self.lock:
            self.send(*call, per_rank=per_rank)
            try:
                out = mine()
            except BaseException as exc:
                self.fail(exc)
                if self.broken is None:
                    self.answers()
                raise
            return out, self.answers()

    def answers(self, timeout_s: float = TIMEOUT_S) -> list[Any]:
        """Every worker's answer to the last call, in rank order; a worker's error is raised (an onnxgen error
        as it is, anything else after stopping the group)."""
        out, first = [], None
        for rank, conn in enumerate(self._conns, start=1):
            kind, value = self._recv(rank, conn, timeout_s)
            if kind == "error" and first is None:
                first = (value, rank)
            out.append(value)
        if first is not None:
            if not isinstance(first[0], BENIGN):
                self.stop(f"worker {first[1]} failed")
            _raise(*first)
        return out

    def _recv(self, rank: int, conn: Any, timeout_s: float) -> tuple[str, Any]:
        try:
            if not conn.poll(timeout_s):
                self.stop(f"worker {rank} did not answer within {timeout_s:.0f} s")
                raise BackendUnavailable(f"the tensor-parallel workers have stopped: {self.broken}")
            return conn.recv()
        except (EOFError, OSError) as exc:
            self.stop(f"worker {rank} exited")
            raise BackendUnavailable(f"the tensor-parallel workers have stopped: {self.broken}") from exc

    def fail(self, exc: BaseException) -> None:
        """Rank 0's own part of a call raised `exc`: a `BENIGN` error leaves the group as it is (every rank raised
        it alike, before any collective), anything else stops it."""
        if not isinstance(exc, BENIGN):
            self.stop(f"rank 0 failed ({type(exc).__name__}: {exc})")

    @property
    def alive(self) -> list[Any]:
        """The worker processes still running."""
        return [p for p in self._procs if p.is_alive()]

    def stop(self, why: str = "the model was closed") -> None:
        """Stop every worker (idempotent); later calls raise `BackendUnavailable` naming `why`."""
        if self.broken is None:
            self.broken = why
        self._finalizer()


def _stop(procs: list[Any], conns: list[Any], tmp: str) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
    for p in procs:
        p.join(STOP_WAIT_S)
        if p.is_alive():
            p.terminate()
            p.join(STOP_WAIT_S)
    for conn in conns:
        conn.close()
    shutil.rmtree(tmp, ignore_errors=True)


def _raise(value: Any, rank: int) -> None:
    if isinstance(value, BaseException):
        raise value
    raise BackendUnavailable(f"tensor-parallel worker {rank} failed: {value}")


def _portable(exc: BaseException) -> Any:
    """`exc` if it survives pickling, else its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return f"{type(exc).__name__}: {exc}"


def _worker_main(rank: int, launch: Launch, conn: Any) -> None:
    """A worker: lower its part, join the group, then run rank 0's calls until `stop` or its pipe closes."""
    envs.set_in_process(envs.MULTICAST_OFF)
    if launch.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.world))
    else:  # pragma: cuda
        torch.cuda.set_device(rank)
    try:
        comm = Comm(
            rank,
            launch.world,
            torch_device(launch.device) if launch.device == "cpu" else torch.device("cuda", rank),
        )
        program, local = rank_program(launch, rank, comm)
        if launch.runner is not None:
            check_batchable(program, local)
        conn.send(("lowered", None))
        comm.connect(launch.store)
        twins: Any
        if launch.runner is None:
            twins = Twins(local, launch.device, launch.options, program)
        else:
            sized = conn.recv()  # ("pages", n) once rank 0 has sized the pool, or ("stop",)
            if sized[0] != "pages":
                return
            opts = {**launch.options, **launch.runner}
            twins = RunnerTwin(local, launch.device, opts, program, comm, sized[1])
        conn.send(("ready", None))
    except BaseException as exc:
        with contextlib.suppress(OSError, ValueError):  # rank 0 may be gone already
            conn.send(("error", _portable(exc)))
        return
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):
            return  # rank 0 is gone
        if call[0] == "stop":
            return
        if call[0] == "drop":
            twins.drop(call[1])
            continue
        try:
            conn.send(("ok", twins.run(call)))
        except BENIGN as exc:
            conn.send(("error", _portable(exc)))
        except BaseException as exc:
            log.exception("tensor-parallel worker %d failed", rank)
            with contextlib.suppress(OSError, ValueError):
                conn.send(("error", _portable(exc)))
            return  # the group's state is unknown: rank 0 stops it
