"""onnxgen on Ray Serve: replicas of one model behind one ingress, routed by session and prefix affinity.

    HTTP ─► Ray Serve proxy ─► Ingress (1 replica: reads the body, `bridge.read_call` → HttpCall + RouteKey)
                                  │ handle.handle.remote(call)   routed by `router.AffinityRouter`
                                  ▼
             Replica × N: one loaded `onnxgen.Model` and the FastAPI app of `onnxgen serve` (`create_app`),
                          the call run through it in process (`bridge.run`); `record_routing_stats` publishes
                          the digests of its sessions and of the prefixes it served

`build(args)` is a Ray Serve application builder (`serve run onnxgen.serve.cluster.deployment:build model=...`,
or `import_path` in a Serve config file); `run_local` starts a local Ray for `onnxgen serve --replicas N`;
`deploy` runs applications at once and waits until they serve, saying what they wait for.

Faults: a call that fails before its response starts (its replica died or was drained) is retried once, then
answered 503 with `Retry-After`; a response that had started ends where the replica stopped. A response's
start is held until the first part of its body arrives, so a replica that dies between the two (a JSON answer
whose headers went out but not its body) is retried too instead of leaving the client a broken response. A
session whose replica is gone is rebound by the router and adopted empty where it lands
(`ServerConfig.adopt_sessions`), or restored from its file with a shared `kv_dir`.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from onnxgen.errors import APIError, ClusterStartError
from onnxgen.serve.cluster.bridge import HttpCall, read_call, run
from onnxgen.serve.cluster.keys import session_digest
from onnxgen.serve.errors import body_for

log = logging.getLogger("onnxgen.serve")

ROUTER = "onnxgen.serve.cluster.router:AffinityRouter"
MAX_PREFIXES = 4096  # prefix digests a replica publishes (most recently served first out)


class Replica:
    """One model and its server app. `model`: package path; `load`: `onnxgen.load` options; `server`:
    `ServerConfig` fields (sessions are adopted: see the module docstring)."""

    def __init__(self, model: str, load: dict[str, Any], server: dict[str, Any]) -> None:
        import onnxgen
        from onnxgen.serve.app import ServerConfig, create_app

        self.id = serve.get_replica_context().replica_id.unique_id
        load = dict(load)
        if load.get("kv_dir"):  # sessions pushed out of memory spill to a folder of this replica's own
            load["kv_dir"] = os.path.join(load["kv_dir"], f"spill-{self.id}")
        self.model = onnxgen.load(model, **load)
        self.app = create_app(self.model, ServerConfig(**{**server, "adopt_sessions": True}))
        self.server = self.app.state.server
        self.prefixes: OrderedDict[str, None] = OrderedDict()

    async def handle(self, call: HttpCall) -> AsyncIterator[dict[str, Any]]:
        """The ASGI messages of `call`'s response; a 2xx answer records the call's prefix digests."""
        async for msg in run(self.app, call, self.id):
            if msg["type"] == "http.response.start" and 200 <= msg["status"] < 300:
                for p in call.route.prefixes:
                    self.prefixes[p] = None
                    self.prefixes.move_to_end(p)
                while len(self.prefixes) > MAX_PREFIXES:
                    self.prefixes.popitem(last=False)
            yield msg

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads as this replica's `routing_stats`."""
        return {
            "sessions": [session_digest(s) for s in self.server.store.ids()],
            "prefixes": list(self.prefixes),
            "inflight": self.server.depth,
        }

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
            self.model.close()


class Ingress:
    """The one HTTP entry: reads each request, hands it to a replica through `replicas` (a handle whose router
    is `AffinityRouter`) and relays the response as it streams."""

    def __init__(self, replicas: Any, isolate_keyless: bool = False) -> None:
        self.replicas = replicas.options(stream=True)
        self.isolate_keyless = isolate_keyless

    def __serve_build_asgi_app__(self) -> Any:
        return _Asgi(self)

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        call = await read_call(scope, receive, self.isolate_keyless)
        for attempt in (1, 2):
            started, head = False, None
            try:
                async for msg in self.replicas.handle.remote(call):
                    if msg["type"] == "http.response.start":  # held until its body's first part has come
                        head = msg
                        continue
                    if head is not None:
                        started = True
                        await send(head)
                        head = None
                    await send(msg)
                return
            except Exception as exc:
                if started:  # the client already has part of the answer: the connection ends here
                    log.warning("a replica failed while answering %s %s: %s", call.method, call.path, exc)
                    raise
                log.warning(
                    "a replica failed before answering %s %s (try %d): %s",
                    call.method,
                    call.path,
                    attempt,
                    exc,
                )
        err = APIError(
            503,
            "no replica could answer this request; retry it",
            code="replica_unavailable",
            headers={"Retry-After": "1"},
        )
        await _answer(send, call.path, err)


class _Asgi:
    """The ingress as an ASGI 3 application object."""

    def __init__(self, ingress: Ingress) -> None:
        self.ingress = ingress

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.ingress.asgi(scope, receive, send)


async def _answer(send: Any, path: str, err: APIError) -> None:
    import json

    body = json.dumps(body_for(path, err)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


@dataclass(frozen=True)
class ClusterConfig:
    """How the application is laid out: `replicas` of the model, each with `num_cpus` / `num_gpus` of Ray's
    resources and at most `max_ongoing` requests in flight; the router's `mode` ("affinity", "round_robin",
    "load") and `imbalance`; how often replicas publish their routing stats (`stats_period_s`); how long
    `run_local` waits for the replicas to load their model and serve (`ready_timeout_s`)."""

    replicas: int = 2
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    max_ongoing: int = 128
    mode: str = "affinity"
    imbalance: int = 4
    stats_period_s: float = 1.0
    isolate_keyless: bool = False
    ready_timeout_s: float = 900.0
    load: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")


def application(model: str, config: ClusterConfig) -> Any:
    """The bound Ray Serve application: the ingress over `config.replicas` replicas of `model`."""
    replica = serve.deployment(
        Replica,
        name="onnxgen-replica",
        num_replicas=config.replicas,
        max_ongoing_requests=config.max_ongoing,
        ray_actor_options={"num_cpus": config.num_cpus, "num_gpus": config.num_gpus},
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER,
            request_router_kwargs={"mode": config.mode, "imbalance": config.imbalance},
            request_routing_stats_period_s=config.stats_period_s,
        ),
    )
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name="onnxgen-ingress",
        num_replicas=1,
        max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": 0},
    )
    server = {**config.server, "isolate_keyless": config.isolate_keyless}
    return ingress.bind(replica.bind(model, config.load, server), config.isolate_keyless)


def build(args: dict[str, Any]) -> Any:
    """Ray Serve application builder (`import_path: onnxgen.serve.cluster.deployment:build`): `args` holds
    `model` (a package path) and optionally `replicas`, `num_cpus`, `num_gpus`, `max_ongoing`, `mode`,
    `imbalance`, `stats_period_s`, `isolate_keyless`, `load` (`onnxgen.load` options) and `server`
    (`ServerConfig` fields)."""
    args = dict(args)
    model = str(args.pop("model"))
    casts = {
        "replicas": int,
        "max_ongoing": int,
        "imbalance": int,
        "num_cpus": float,
        "num_gpus": float,
        "stats_period_s": float,
    }
    for name, cast in casts.items():
        if name in args:
            args[name] = cast(args[name])
    if isinstance(args.get("isolate_keyless"), str):
        args["isolate_keyless"] = args["isolate_keyless"].lower() in ("1", "true", "yes")
    return application(model, ClusterConfig(**args))


def replica_gpus(device: str, replicas: int) -> float:
    """GPUs each of `replicas` asks Ray for by default: a card each where there are enough, else the visible
    cards shared evenly (two replicas on one card: half each); none on the CPU."""
    if device != "cuda":
        return 0.0
    import torch

    return min(1.0, torch.cuda.device_count() / replicas)


def start_ray(cuda: bool) -> None:
    """A local Ray for replicas: no dashboard, actors' output in their log files; with `cuda`, told the cards
    this process sees rather than left to its own detection."""
    import ray

    cards = None
    if cuda:
        import torch

        cards = torch.cuda.device_count()
    ray.init(include_dashboard=False, log_to_driver=False, num_gpus=cards)


def deploy(
    apps: Sequence[tuple[str, str, Any]],
    *,
    timeout_s: float = 900.0,
    every_s: float = 15.0,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Run the applications `(name, route prefix, bound application)` on the connected Serve at once (their
    replicas load side by side) and return when every one is running. While they come up, `progress` gets a
    line every `every_s` seconds with each deployment's state, replica states and Serve's message (replicas
    that cannot be placed say what they ask for and what the cluster has). An application that fails to
    deploy, or one not running after `timeout_s`, raises `ClusterStartError` with the same description; the
    applications of this call are deleted first, so nothing half-started keeps resources."""
    names = [name for name, _, _ in apps]
    serve.run_many(
        [serve.RunTarget(target=app, name=name, route_prefix=prefix) for name, prefix, app in apps],
        wait_for_applications_running=False,
    )
    start = last = time.monotonic()
    while True:
        states = serve.status().applications
        now = time.monotonic()
        failed = [n for n in names if n in states and states[n].status == "DEPLOY_FAILED"]
        if not failed and all(n in states and states[n].status == "RUNNING" for n in names):
            return
        if failed or now - start > timeout_s:
            why = (
                f"{', '.join(failed)} failed to deploy" if failed else f"not running after {timeout_s:.0f} s"
            )
            text = _describe(states, names)
            for name in names:
                serve.delete(name, _blocking=False)
            raise ClusterStartError(f"Ray Serve application(s) {', '.join(names)}: {why}. {text}")
        if progress is not None and now - last >= every_s:
            progress(f"waiting for {', '.join(names)} ({now - start:.0f} s): {_describe(states, names)}")
            last = now
        time.sleep(0.25)


def _describe(states: dict[str, Any], names: Sequence[str]) -> str:
    """Each application's state and its deployments' (state, replica states, message), on one line."""
    parts = []
    for name in names:
        app = states.get(name)
        if app is None:
            parts.append(f"{name}: not created yet")
            continue
        deps = "; ".join(
            f"{dep}: {d.status} {dict(d.replica_states)}" + (f" ({d.message})" if d.message else "")
            for dep, d in app.deployments.items()
        )
        parts.append(f"{name}: {app.status}" + (f" ({app.message})" if app.message else "") + f" [{deps}]")
    return " | ".join(parts)


def run_local(
    model: str,
    config: ClusterConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Start a local Ray, serve the application on `host:port` until interrupted (Ctrl-C or SIGTERM), then
    shut Serve and Ray down. Replicas not serving within `config.ready_timeout_s` raise `ClusterStartError`
    (`deploy`); `progress` (default: the log at INFO) hears what they wait for every 15 s meanwhile, and when
    they serve."""
    say = progress or log.info
    import signal

    import ray

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)

    if not ray.is_initialized():
        start_ray(cuda=config.num_gpus > 0)
    try:
        serve.start(http_options={"host": host, "port": port})
        deploy([("onnxgen", "/", application(model, config))], timeout_s=config.ready_timeout_s, progress=say)
        say(f"onnxgen: {config.replicas} replica(s) serving on http://{host}:{port}")
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
