"""Prometheus metrics, written in the text exposition format by hand (no prometheus_client).

Counters: requests by route and status, prompt / completion / reused tokens. Histogram: time to
first token. Gauges (read at scrape time): queue depth, open sessions, retained KV bytes. Thread-safe.
`CountRequests` is the ASGI middleware that counts every response by route and status.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.reused_tokens = 0
        self.cancelled = 0
        self._ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self._ttft_sum = 0.0
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}

    def request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def generation(self, prompt: int, completion: int, reused: int, ttft_s: float) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.completion_tokens += completion
            self.reused_tokens += reused
            i = next((k for k, b in enumerate(TTFT_BUCKETS) if ttft_s <= b), len(TTFT_BUCKETS))
            self._ttft_counts[i] += 1
            self._ttft_sum += ttft_s

    def cancel(self) -> None:
        with self._lock:
            self.cancelled += 1

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.gauges[name] = (help_text, read)

    def render(self) -> str:
        """The exposition text (Content-Type: text/plain; version=0.0.4)."""
        with self._lock:
            lines = [
                "# HELP onnxgen_requests_total HTTP requests by route and status code.",
                "# TYPE onnxgen_requests_total counter",
            ]
            for (route, status), n in sorted(self.requests.items()):
                lines.append(f'onnxgen_requests_total{{route="{_esc(route)}",status="{status}"}} {n}')
            for name, help_text, value in (
                ("onnxgen_prompt_tokens_total", "Prompt tokens of finished generations.", self.prompt_tokens),
                (
                    "onnxgen_completion_tokens_total",
                    "Generated tokens of finished generations.",
                    self.completion_tokens,
                ),
                (
                    "onnxgen_reused_tokens_total",
                    "Prompt tokens served from retained KV (not prefilled).",
                    self.reused_tokens,
                ),
                (
                    "onnxgen_cancelled_total",
                    "Generations cancelled (e.g. client disconnected).",
                    self.cancelled,
                ),
            ):
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
            lines += [
                "# HELP onnxgen_ttft_seconds Time to first token of finished generations.",
                "# TYPE onnxgen_ttft_seconds histogram",
            ]
            cum = 0
            for b, c in zip(TTFT_BUCKETS, self._ttft_counts, strict=False):
                cum += c
                lines.append(f'onnxgen_ttft_seconds_bucket{{le="{b}"}} {cum}')
            cum += self._ttft_counts[-1]
            lines += [
                f'onnxgen_ttft_seconds_bucket{{le="+Inf"}} {cum}',
                f"onnxgen_ttft_seconds_sum {self._ttft_sum:.6f}",
                f"onnxgen_ttft_seconds_count {cum}",
            ]
        for name, (help_text, read) in self.gauges.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {read():g}"]
        return "\n".join(lines) + "\n"


class CountRequests:
    """Pure ASGI middleware counting responses by route and status (streams stay unbuffered). `label`
    maps a request path to its route's name (so ids in paths do not make a series each)."""

    def __init__(self, app: Any, metrics: Metrics, label: Callable[[str], str]) -> None:
        self.app = app
        self.metrics = metrics
        self.label = label

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self.label(scope.get("path", ""))
        status = [500]

        async def send_wrapper(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.request(route, status[0])
