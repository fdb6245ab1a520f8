"""Engines for tests that look inside: built as `onnxgen.load` builds them, with any configuration, and
driven either by the model's loop thread (`loaded`) or by the test's own thread, one step at a time
(`Stepper`: deterministic, so the engine's state can be read between steps and right after a request)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from onnxgen.config import Config
from onnxgen.engine.engine import Engine
from onnxgen.engine.model import Model
from onnxgen.engine.output import Handle, Result
from onnxgen.engine.request import Request
from onnxgen.engine.session import Session
from onnxgen.package import load_spec


def engine(path: str | Path, **options: Any) -> Engine:
    """An engine over the package at `path` with the `onnxgen.load` options given."""
    return Engine(load_spec(Path(path)), Config().replace(**options))


def loaded(path: str | Path, **options: Any) -> tuple[Engine, Model]:
    """An engine and the `Model` over it (the model's loop thread drives it): spy on the engine's parts while
    using the public API."""
    e = engine(path, **options)
    return e, Model(e)


@contextmanager
def eos(e: Engine, ids: tuple[int, ...]) -> Iterator[None]:
    """Requests submitted meanwhile end on `ids` instead of the package's EOS ids."""
    saved = e.inputs.eos_ids
    e.inputs.eos_ids = ids
    try:
        yield
    finally:
        e.inputs.eos_ids = saved


class Stepper:
    """Drives an engine that has no loop thread from the calling thread: `submit` queues, `wait` steps until a
    request is done. The API of `Model` (generate, submit, session) on top."""

    def __init__(self, e: Engine) -> None:
        self.engine = e
        self._default = Session(e, name="default")

    def __getattr__(self, name: str) -> Any:  # what the engine has (kv_stats, settle, executor, pipeline ...)
        return getattr(self.engine, name)

    def wait(self, handle: Handle) -> Result:
        while not handle.done():
            if not self.engine.has_work():
                raise AssertionError("the request is not done and the engine has nothing to do")
            self.engine.step()
        return handle.result()

    def submit(
        self,
        prompt: Any,
        *,
        on_token: Callable[[str], Any] | None = None,
        cancel: threading.Event | None = None,
        **options: Any,
    ) -> Ticket:
        e = self.engine
        if not e.paged:
            return Ticket(self, self._default.submit(prompt, on_token=on_token, cancel=cancel, **options))
        prepared = e.prepare(prompt, **options)
        handle = Handle(cancel)

        def done(req: Request) -> None:
            if req.error is not None:
                handle.set_error(req.error)
            else:
                handle.set_result(e.result_of(req))

        req = e.submit(prepared, on_token=on_token, cancel=handle.cancel_event, on_done=done)
        return Ticket(self, handle, req)

    def generate(self, prompt: Any, **options: Any) -> Result:
        return self.submit(prompt, **options).result()

    def step(self) -> bool:
        return self.engine.step()

    def session(self, name: str | None = None, *, salt: str | None = None) -> SteppedSession:
        return SteppedSession(self, Session(self.engine, name, salt=salt))


class Ticket:
    """A request submitted to a `Stepper`: `result()` steps the engine until it is done."""

    def __init__(self, stepper: Stepper, handle: Handle, request: Request | None = None) -> None:
        self.stepper = stepper
        self.handle = handle
        self.request = request  # the engine's record (paged requests)

    def done(self) -> bool:
        return self.handle.done()

    @property
    def error(self) -> BaseException | None:
        """What the request failed with (None: not done, or succeeded)."""
        return self.handle.future.exception() if self.handle.done() else None

    def result(self) -> Result:
        return self.stepper.wait(self.handle)


class SteppedSession:
    """A `Session` whose `generate` steps its `Stepper`'s engine until the result is in."""

    def __init__(self, stepper: Stepper, session: Session) -> None:
        self.stepper = stepper
        self.session = session

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def generate(self, prompt: Any, **options: Any) -> Result:
        return self.stepper.wait(self.session.submit(prompt, **options))


def stepper(path: str | Path, **options: Any) -> Stepper:
    """A `Stepper` over a new engine for the package at `path`."""
    return Stepper(engine(path, **options))


def set_policy(e: Any, **changes: Any) -> None:
    """Change an engine's decode-run policy (`RunPolicy` fields: decode_steps, launch_first, first_run_steps,
    spec_decode_steps) from the next step on: tests switch policies on one engine and its pool."""
    import dataclasses

    pipeline = e.pipeline
    pipeline.policy = dataclasses.replace(pipeline.policy, **changes)
