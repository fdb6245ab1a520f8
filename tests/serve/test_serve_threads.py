"""One engine loop: the server runs many streams on a handful of threads, and a request's streaming callback
runs on the model's loop thread, never on another request's caller (the Python API and the server)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import onnxgen  # noqa: E402
from onnxgen.serve.app import RunningServer, ServerConfig, create_app  # noqa: E402
from tests.conftest import native_available  # noqa: E402

pytestmark = pytest.mark.skipif(not native_available(), reason="native backend not importable")

STREAMS = 64
MOST_THREADS = 8  # main, the server's thread, the engine loop, two preparation threads, and a little room


@pytest.fixture(scope="module")
def paged(tiny_dir: Path):
    m = onnxgen.load(str(tiny_dir), backend="native", max_running=STREAMS)
    assert m.paged
    return m


def test_callbacks_run_on_the_loop_thread_never_on_another_callers(paged) -> None:
    """Eight caller threads at once: every `on_token` of every request runs on the one loop thread, which is
    none of the callers; each caller gets exactly its own text."""
    callers: dict[int, threading.Thread] = {}
    seen: dict[int, set[str]] = {}
    texts: dict[int, str] = {}
    barrier = threading.Barrier(8)

    def caller(i: int) -> None:
        callers[i] = threading.current_thread()
        seen[i] = set()
        pieces: list[str] = []

        def on_token(piece: str) -> None:
            seen[i].add(threading.current_thread().name)
            pieces.append(piece)

        barrier.wait()
        r = paged.generate([5 + i, 9, 2, 33, 7, 11 + i], max_new_tokens=12, temperature=0, on_token=on_token)
        assert "".join(pieces) == r.text
        texts[i] = r.text

    threads = [threading.Thread(target=caller, args=(i,), name=f"caller-{i}") for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    names = set().union(*seen.values())
    assert names == {"onnxgen-engine"}, names
    assert not names & {t.name for t in callers.values()}
    for i in range(8):
        alone = paged.generate([5 + i, 9, 2, 33, 7, 11 + i], max_new_tokens=12, temperature=0, reuse=False)
        assert texts[i] == alone.text


def test_sixty_four_streams_on_a_handful_of_threads(paged) -> None:
    """64 concurrent streamed chat completions (one asyncio client, so every thread counted is the server's
    or the test's main one): all complete with their own text, and the process never runs more than
    `MOST_THREADS` threads meanwhile (besides those earlier tests left running)."""
    leftover = threading.active_count() - 1  # threads other tests left behind (the main one aside)
    app = create_app(paged, ServerConfig(max_queue=STREAMS))
    peak = {"threads": 0}
    with RunningServer(app) as srv:
        model_id = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]

        async def one(client: httpx.AsyncClient, i: int) -> str:
            body = {
                "model": model_id,
                "messages": [{"role": "user", "content": f"stream number {i}"}],
                "max_tokens": 24,
                "temperature": 0,
                "stream": True,
            }
            text = []
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    peak["threads"] = max(peak["threads"], threading.active_count())
                    if line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        text.append(delta.get("content") or "")
            return "".join(text)

        async def main() -> list[str]:
            limits = httpx.Limits(max_connections=STREAMS)
            async with httpx.AsyncClient(base_url=srv.url, timeout=300, limits=limits) as client:
                return await asyncio.gather(*(one(client, i) for i in range(STREAMS)))

        before = threading.active_count()
        got = asyncio.run(main())
    assert len(got) == STREAMS and all(got)
    for i in (0, 17, 63):
        alone = paged.generate(
            [{"role": "user", "content": f"stream number {i}"}], max_new_tokens=24, temperature=0, reuse=False
        )
        assert got[i] == alone.text
    assert peak["threads"] - leftover <= MOST_THREADS, (leftover, before, peak)
