"""The engine: one loaded package's KV, scheduler and step, driven by one loop thread.

    engine.submit(prepared, ...)   -> Request      any thread: queue a prepared request (engine/input.py)
    engine.step()                  -> bool         the loop's: schedule -> run one batch -> postprocess
    engine.abort(req)                              any thread: it stops at its next step

A step schedules chunks within a token budget (`engine/scheduler.py`), runs them as one batch (or as a run
of decode steps, `engine/pipeline.py`), samples, streams and stops; a finished request commits its KV (its
owner's `on_done` takes what it keeps), a failed one drops it. KV comes from one of two executors: a paged
pool shared by every request with a prefix index (`engine/paged.py`; the native backend on packages it can
batch) or one decoder per request (`engine/slots.py`; ort, and native packages it cannot batch).

`EngineLoop` (engine/loop.py) is the one thread that calls `step`: callers (the Python API, the server)
submit and wait on their request's future, and every callback (`on_token`, `on_done`) runs on the loop
thread, never on another request's caller. Tests may step an engine that has no loop themselves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from onnxgen.config import Config
from onnxgen.engine import persist
from onnxgen.engine.drafts import DraftControl, draft_control
from onnxgen.engine.executors import build_executor
from onnxgen.engine.input import InputProcessor, Prepared
from onnxgen.engine.output import Result, result_of
from onnxgen.engine.pipeline import DecodePipeline, RunPolicy
from onnxgen.engine.request import Request, Status, sample_chunks
from onnxgen.engine.scheduler import Chunk, Scheduler
from onnxgen.engine.session import SessionRegistry
from onnxgen.engine.slots import DecoderPool
from onnxgen.engine.spill import Spill
from onnxgen.errors import Cancelled, DeviceOutOfMemory
from onnxgen.package.spec import ModelSpec

log = logging.getLogger(__name__)


class Engine:
    """A loaded model package's request machinery. `onnxgen.Model` wraps it (with an `EngineLoop`).

    Thread-safety: `submit`, `abort`, `drop_state`, `state_bytes`, `kv_stats`, `settle` and `close` may be
    called from any thread; `step` from one thread at a time (the loop's)."""

    def __init__(self, spec: ModelSpec, config: Config | None = None) -> None:
        """Builds the backend (a paged runner when it can batch the package and `cache.paged` allows, else a
        decoder pool), the scheduler and the input processor. Raises `BackendUnavailable` (the backend's
        dependencies are missing, or `cache.paged=True` where it cannot batch) and the backend's load errors
        (`engine/executors.build_executor`)."""
        from onnxgen.text import ChatTemplate, Tokenizer
        from onnxgen.text.tools import detect_format, get_format

        self.config = config = config or Config()
        self.spec = spec.with_chunk_size(config.scheduler.chunk_size)
        self.device = config.model.device
        self.backend = config.model.resolved_backend()
        cuda = config.model.cuda
        self.tokenizer = Tokenizer.from_spec(self.spec)
        self.chat_template = ChatTemplate.from_spec(self.spec, self.tokenizer)
        self.eos_token_ids = tuple(dict.fromkeys((*self.spec.eos_token_ids, *self.tokenizer.eos_token_ids)))
        source = self.chat_template.source if self.chat_template is not None else None
        parser = config.model.tool_parser
        self.tool_format = get_format(parser) if parser else detect_format(source)
        package_key = f"{self.spec.path.resolve()}|{self.spec.kv_dtype}|{self.backend}|{self.device}"
        self.inputs = InputProcessor(
            self.spec,
            self.tokenizer,
            self.chat_template,
            self.tool_format,
            package_key=package_key,
            eos_ids=self.eos_token_ids,
            max_new_tokens=config.decoding.max_new_tokens,
        )
        self.executor: Any = build_executor(self.spec, config, self.backend)
        self.pool: DecoderPool | None = getattr(self.executor, "pool", None)  # SlotKV's decoders
        self.paged: bool = self.executor.paged
        dec = config.decoding
        self.policy = RunPolicy(
            decode_steps=dec.steps_for(cuda, self.paged),
            spec_decode_steps=dec.spec_decode_steps,
            launch_first=dec.launch_first_for(cuda),
            first_run_steps=dec.first_run_steps,
        )
        self.speculative = dec.speculative
        self.speculate_alone = dec.alone_for(cuda)
        sch = config.scheduler
        running = sch.running_for(cuda, self.paged)
        budget = max(sch.budget_for(cuda, self.paged), running)
        self.scheduler = Scheduler(
            self.executor, max_running=running, token_budget=budget, preempt=self.paged, fair=sch.fair
        )
        self.pipeline = DecodePipeline(
            self.executor, self.scheduler, self.policy, paged=self.paged, finish=self._finish, fail=self._fail
        )
        cache = config.cache
        host = cache.host_bytes_for(cuda)  # a paged pool holds its host tier itself (`kv/tiers.py`)
        tiers = (
            Spill(self, cache.kv_dir, cache.kv_dir_bytes, 0 if self.paged else host)
            if cache.kv_dir or host
            else None
        )
        self.registry = SessionRegistry(cache.max_sessions, cache.max_kv_bytes, tiers)
        self.kv_lock = threading.RLock()  # held by the step, and by whoever changes KV state from outside
        self._snapshot: dict[str, Any] = {}  # the last `kv_stats`, for `kv_snapshot` while a step runs
        self._stuck = 0
        self.file_counters = persist.FileCounters()
        self.notify: Callable[[], None] = lambda: None  # the loop's wake-up (set by `EngineLoop`)
        self._snapshot = self.kv_stats()

    # --- requests in ---------------------------------------------------------------------------------

    def prepare(self, prompt: Any, **options: Any) -> Prepared:
        """Check and encode a request once (`InputProcessor.prepare`); raises `InvalidRequest`."""
        return self.inputs.prepare(prompt, **options)

    def submit(
        self,
        prepared: Prepared,
        *,
        owner: Any = None,
        held: Any = None,
        history: Sequence[int] = (),
        salt: str | None = None,
        on_token: Callable[[str], Any] | None = None,
        cancel: threading.Event | None = None,
        on_done: Callable[[Request], None] | None = None,
    ) -> Request:
        """Queue `prepared` and return its record at once. `owner`: the session its context is kept for (None:
        nobody; with paged KV its pages still join the prefix index). `held`: the owner's retained state, taken
        for this request: disposed of on every path (reused, replaced, or dropped on failure). `history`: the
        ids of the owner's last context, which a chat prompt keeps where it spells them (`InputProcessor.
        rebase`). `salt` (else the prepared one): part of the identity. `on_done(req)`: called once on the
        loop thread when the request has finished or failed (`req.error`, `req.kept`: the state the owner
        keeps). Raises what `rebase` raises (the held state dropped)."""
        try:
            ids = self.inputs.rebase(prepared, history if prepared.reuse else ())
            req = self.inputs.request(
                prepared,
                ids,
                owner=owner,
                held=held,
                salt=salt if salt is not None else prepared.salt,
                drafts=self.draft_control(prepared.speculative),
                on_token=on_token,
                cancel=cancel,
                on_done=on_done,
            )
        except BaseException:
            self.drop_state(held)
            raise
        self.scheduler.add(req)
        self.notify()
        return req

    def draft_control(self, speculative: str | bool | None) -> DraftControl | None:
        """The request's draft length control, or None when it decodes one token per step."""
        mode = self.speculative if speculative is None else speculative
        if mode in (False, "off"):
            return None
        return draft_control(self.device == "cuda", self.executor.verify_sizes, solo=self.speculate_alone)

    def abort(self, req: Request) -> None:
        """Cancel `req`: it fails with `Cancelled` at the next step (nothing of it stays in the cache)."""
        if req.cancel is None:
            req.cancel = threading.Event()
        req.cancel.set()
        self.notify()

    def has_work(self) -> bool:
        """Whether a request is queued, waiting or running."""
        return self.scheduler.has_work()

    def result_of(self, req: Request) -> Result:
        """The `Result` of a finished request."""
        return result_of(
            req,
            backend=self.backend,
            device=self.device,
            chunk_size=self.spec.chunk_size,
            tool_format=self.tool_format,
        )

    # --- the step -------------------------------------------------------------------------------------

    def step(self) -> bool:
        """One engine step: schedule, run the batch, sample and stream, finish or fail requests. Returns
        False when there was nothing to do."""
        with self.kv_lock:
            self.pipeline.settle()
            chunks, cancelled = self.scheduler.schedule()
            for req in cancelled:
                self._fail(req, Cancelled("generation cancelled"))
            if not chunks:
                if self.scheduler.waiting and not self.scheduler.running:
                    self._unstick()
                return bool(cancelled)
            self._stuck = 0
            k = self.pipeline.run_length(chunks)
            if k > 1:
                self.pipeline.run(chunks, k)
                return True
            try:
                outs = self.executor.run(chunks)
            except Exception as exc:  # the batch failed: every request in it fails
                for c in chunks:
                    self._fail(c.req, exc)
                return True
            self._postprocess(chunks, outs)
            return True

    def _postprocess(self, chunks: Sequence[Chunk], outs: Sequence[Any]) -> None:
        """Sample every chunk that samples (or verify its drafts), stream, and end finished or failed
        requests. A step of prompts' last chunks may first launch their first decode run behind the device's
        choice of their first tokens (`DecodePipeline.first_run_length`), continued once the tokens are taken."""
        k, decodes = self.pipeline.first_run_length(chunks)
        first = self.pipeline.launch_first(decodes, outs, k) if k else None
        if first is not None:  # prompts' ends: their first decode run launched before their tokens are read
            tokens, run = first
            picked: dict[int, Any] = dict(enumerate(tokens))
        else:  # every sampled row's token in one call (one host transfer); a processor's error fails its request
            rows = [
                i
                for i, (c, out) in enumerate(zip(chunks, outs, strict=True))
                if c.sample and not c.draft and out is not None and not isinstance(out, BaseException)
            ]
            picked = sample_chunks(chunks, outs, rows)
        for i, (c, out) in enumerate(zip(chunks, outs, strict=True)):
            req = c.req
            if isinstance(out, BaseException):
                self._fail(req, out)
                continue
            req.computed = c.start + c.n
            if not c.sample:
                continue
            if c.draft:
                self._verify(c, out)
                continue
            if isinstance(picked.get(i), BaseException):
                self._fail(req, picked[i])
                continue
            try:
                finished = req.accept(out, picked.get(i))
            except Exception as exc:  # a processor or the on_token callback
                self._fail(req, exc)
                continue
            if finished:
                self._finish(req)
        if first is not None:
            self.pipeline.continue_first(run, k)

    def _verify(self, c: Chunk, rows: Any) -> None:
        """A decode step that fed drafts: sample its rows as plain decoding would, keep the drafts up to the
        first that differs from its sample, and take the rest back out of the cache."""
        req = c.req
        try:
            finished, taken = req.accept_drafted(rows, c.draft)
        except Exception as exc:  # a processor or the on_token callback
            self._fail(req, exc)
            return
        req.drafts.update(len(c.draft), taken - 1, len(req.output))
        req.computed = c.start + taken  # the fed tokens the samples confirmed
        if taken < len(c.draft) + 1:
            try:
                self.executor.discard(req, req.computed)
            except Exception as exc:
                self._fail(req, exc)
                return
        if finished:
            self._finish(req)

    # --- requests out -----------------------------------------------------------------------------------

    def _finish(self, req: Request) -> None:
        self.scheduler.remove(req)
        try:
            req.kept = self.executor.finish(req)
        except Exception as exc:
            self._fail(req, exc)
            return
        self.executor.drop(req.held)
        req.held = None
        self._resolve(req)

    def _fail(self, req: Request, exc: BaseException) -> None:
        self.scheduler.remove(req)
        self.executor.release(req)
        self.executor.drop(req.held)
        req.held = None
        req.error = exc
        self._resolve(req)

    def _resolve(self, req: Request) -> None:
        """The request is over: tell its owner (`on_done`, whose failure is logged, never raised into the
        step), then its waiters. With no `on_done`, the state it would keep is dropped."""
        req.status = Status.FINISHED
        req.t_done = time.perf_counter()
        if req.on_done is not None:
            try:
                req.on_done(req)
            except Exception:
                log.exception("a request's on_done callback failed")
        elif req.kept is not None:
            self.executor.drop(req.kept)
            req.kept = None
        req.done.set()

    def _unstick(self) -> None:
        """Nothing runs and the first waiting request cannot get KV: first let every session's pinned context
        go (they become evictable); if that was done already, the request cannot fit at all."""
        if self._stuck == 0:
            self._stuck = 1
            self.registry.evict_all()
            return
        req = self.scheduler.waiting[0]
        cap = getattr(self.executor, "capacity_tokens", 0)
        self._fail(
            req,
            DeviceOutOfMemory(
                f"the KV pool holds {cap} tokens and cannot hold this request's {req.num_tokens}: load the model "
                f"with a larger kv_bytes, or send a shorter prompt"
            ),
        )

    def fail_all(self, exc: BaseException) -> None:
        """Fail every queued, waiting and running request with `exc` (the loop's last resort, and `close`)."""
        with self.kv_lock:
            for req in self.scheduler.pending():
                self.scheduler.forget_incoming(req)
                if req.status is not Status.FINISHED:
                    self._fail(req, exc)

    # --- KV state kept by sessions --------------------------------------------------------------------

    def settle(self) -> None:
        """Wait for the device work launched past requests that already finished (`DecodePipeline.tail`).
        Every step does this first, and `close` too; a benchmark calls it before timing a request, so that the
        request does not pay for the previous one's tail. Safe from any thread."""
        with self.kv_lock:
            self.pipeline.settle()

    def drop_state(self, state: Any) -> None:
        """Let go of a session's retained state (its decoder back to the pool, or its pin)."""
        if state is not None:
            with self.kv_lock:
                self.executor.drop(state)

    def state_bytes(self, state: Any) -> int:
        return self.executor.state_bytes(state) if state is not None else 0

    def save_state(self, state: Any, path: Any, salt: str | None, name: str = "", note: str = "") -> int:
        """Write a retained state to a session file; returns its size (`persist.save`). Any thread."""
        return persist.save(self, state, path, salt, name, note)

    def load_state(self, path: Any, salt: str | None) -> tuple[Any, Any]:
        """A session file's header and the retained state made from it (`persist.load`). Any thread."""
        return persist.load(self, path, salt)

    def kv_stats(self) -> dict[str, Any]:
        """KV and scheduling numbers now: running and waiting requests, preemptions, the KV sessions retain,
        and for paged KV the pool's pages (total, free, used, indexed, shared), pinned sessions and
        prefix-cache hits."""
        with self.kv_lock:
            out: dict[str, Any] = {
                "paged": self.paged,
                "running": len(self.scheduler.running),
                "waiting": self.scheduler.num_waiting(),
                "preemptions": self.scheduler.preemptions,
            }
            out.update(self.executor.stats())
        out.update(self.registry.stats())  # retained_kv_bytes; spilled sessions with a kv_dir
        out.update(self.file_counters.stats())
        return out

    def kv_snapshot(self) -> dict[str, Any]:
        """`kv_stats` if the step's lock is free now, else the last numbers computed (never waits for a step;
        the running and waiting counts are read live). Any thread."""
        if self.kv_lock.acquire(blocking=False):
            try:
                self._snapshot = self.kv_stats()
            finally:
                self.kv_lock.release()
        snap = dict(self._snapshot)
        snap["running"] = len(self.scheduler.running)
        snap["waiting"] = self.scheduler.num_waiting()
        return snap

    def close(self) -> None:
        """Free the device memory of every cache: retained sessions (they stay usable and reuse nothing next
        time), idle pooled decoders or the unpinned pages of the index. Requests queued or running go on. The
        weights go when the last engine of the package is dropped."""
        self.registry.close()
        with self.kv_lock:
            self.pipeline.settle()
            self.executor.close()
