"""`onnxgen serve`: the HTTP server (OpenAI chat completions, completions and responses; Anthropic messages;
see onnxgen.serve)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from onnxgen.cli.options import add_model_args, load_model
from onnxgen.errors import InvalidRequest

PREFILL_CHUNK = 512  # the server's prefill chunk unless --prefill-chunk sets one


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the model over OpenAI- and Anthropic-compatible HTTP APIs",
        description="Serve /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/models, "
        "/v1/sessions, /health and /metrics. Binds 127.0.0.1 unless --host says otherwise. Every request reuses "
        "cached prefixes (within its API key's tenancy); a session (X-Session-Id, POST /v1/sessions) keeps one "
        "conversation's KV, and a stored response keeps its conversation's for previous_response_id.",
    )
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="default: 8000")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (repeatable)",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="read API keys from FILE, one per line (# comments allowed)",
    )
    p.add_argument(
        "--max-sessions",
        type=int,
        default=8,
        metavar="N",
        help="sessions whose KV is retained at once (LRU beyond; default: 8)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="requests that may wait for the engine; beyond, 429 with Retry-After (default: 64)",
    )
    p.add_argument(
        "--model-id", default=None, help="the model name clients use (default: the package folder's name)"
    )
    p.add_argument(
        "--max-tokens-cap",
        type=int,
        default=2048,
        metavar="N",
        help="most tokens one request may generate; also the default max_tokens (default: 2048)",
    )
    p.add_argument(
        "--metrics-key",
        action="append",
        default=None,
        metavar="KEY",
        help="with API keys: a key that may read /metrics, which shows every tenant's traffic (repeatable)",
    )
    p.add_argument(
        "--isolate-keyless",
        action="store_true",
        help="without API keys: requests share no cached prefix unless they name a session or a cache_salt "
        "(for keyless multi-tenant deployments; reuse is otherwise observable through timing)",
    )
    p.add_argument(
        "--session-ttl",
        type=float,
        default=3600.0,
        metavar="S",
        help="seconds a session may go unused before it expires (default: 3600)",
    )
    p.add_argument(
        "--sessions-per-client",
        type=int,
        default=64,
        metavar="N",
        help="without API keys: sessions one client address may hold (default: 64)",
    )
    p.add_argument(
        "--kv-dir",
        metavar="DIR",
        help="save sessions here (POST /v1/sessions/{id}/save, and all at shutdown) and restore them by id; "
        "sessions pushed out of memory (--max-sessions) spill to DIR/spill and resume from it",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds a request may run before it is cancelled and answered 504 (default: 600)",
    )
    p.add_argument(
        "--allow-remote-images",
        action="store_true",
        help="fetch http(s) image URLs of content parts (vision models; default: only data: URLs)",
    )
    g = p.add_argument_group("replicas (Ray Serve; pip install 'onnxgen[cluster]')")
    g.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="serve N replicas of the model behind one Ray Serve ingress on a local Ray, routed by session "
        "and cached prefix (see docs/serve.md)",
    )
    g.add_argument(
        "--router",
        choices=("affinity", "round_robin", "load"),
        default="affinity",
        help="with --replicas: how requests pick a replica (default: affinity)",
    )
    g.add_argument(
        "--replica-gpus",
        type=float,
        default=None,
        metavar="F",
        help="with --replicas: GPUs per replica (default with --device cuda: 1 where there is a card per "
        "replica, else the cards shared evenly, e.g. 0.5 for 2 replicas on one card; else 0)",
    )
    p.set_defaults(func=run)


def read_keys(args: argparse.Namespace) -> tuple[str, ...]:
    keys = [k.strip() for k in args.api_key or [] if k.strip()]
    if args.api_key_file is not None:
        try:
            lines = args.api_key_file.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise InvalidRequest(
                f"{args.api_key_file}: cannot read API keys ({exc})", field="api_key_file"
            ) from exc
        keys += [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
        if not keys:
            raise InvalidRequest(f"{args.api_key_file}: holds no API key", field="api_key_file")
    return tuple(dict.fromkeys(keys))


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from onnxgen.serve.app import UVICORN_OPTIONS, ServerConfig, create_app
    except ImportError as exc:
        raise InvalidRequest(
            f"the server needs the serve extra: pip install 'onnxgen[serve]' ({exc})"
        ) from exc
    if min(args.max_sessions, args.max_queue, args.max_tokens_cap, args.sessions_per_client) < 1:
        raise InvalidRequest(
            "--max-sessions, --max-queue, --max-tokens-cap and --sessions-per-client must be >= 1",
            field="max_sessions",
        )
    if not args.session_ttl > 0:
        raise InvalidRequest(f"--session-ttl must be > 0, got {args.session_ttl}", field="session_ttl")
    if not args.request_timeout > 0:
        raise InvalidRequest(
            f"--request-timeout must be > 0, got {args.request_timeout}", field="request_timeout"
        )
    keys = read_keys(args)
    if args.prefill_chunk is None:  # the loop checks cancellation and timeouts between chunks
        args.prefill_chunk = PREFILL_CHUNK
    config = ServerConfig(
        api_keys=keys,
        max_queue=args.max_queue,
        model_id=args.model_id,
        max_tokens_cap=args.max_tokens_cap,
        request_timeout_s=args.request_timeout,
        metrics_keys=tuple(args.metrics_key or ()),
        isolate_keyless=args.isolate_keyless,
        session_ttl_s=args.session_ttl,
        max_sessions_per_client=args.sessions_per_client,
        kv_dir=args.kv_dir,
        allow_remote_images=args.allow_remote_images,
    )
    if args.replicas is not None:
        if args.tensor_parallel != 1:
            raise InvalidRequest(
                "--tensor-parallel with --replicas is not supported yet: run one server with "
                "--tensor-parallel N, or replicas of one rank each",
                field="tensor_parallel",
            )
        return run_replicas(args, config)
    spill = str(Path(args.kv_dir) / "spill") if args.kv_dir else None  # sessions pushed out of memory
    model = load_model(args, max_sessions=args.max_sessions, kv_dir=spill)
    app = create_app(model, config)
    auth = (
        f"{len(keys)} API key(s)"
        if keys
        else "no API key (anyone who can reach the port can use it"
        + (
            "; requests share no KV unless they name a session)"
            if args.isolate_keyless
            else "; requests share cached prefixes)"
        )
    )
    print(
        f"onnxgen: serving {app.state.server.model_id!r} on http://{args.host}:{args.port}/v1 · "
        f"{model.backend}/{model.device} · {auth}",
        file=sys.stderr,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, **UVICORN_OPTIONS)
    app.state.server.close()
    return 0


def run_replicas(args: argparse.Namespace, config: Any) -> int:
    """`--replicas N`: the same server in N Ray Serve replicas behind one ingress, on a local Ray."""
    import dataclasses
    import os

    if args.replicas < 1:
        raise InvalidRequest(f"--replicas must be >= 1, got {args.replicas}", field="replicas")
    try:
        from onnxgen.serve.cluster.deployment import ClusterConfig, replica_gpus, run_local
    except ImportError as exc:
        raise InvalidRequest(
            f"--replicas needs the cluster extra: pip install 'onnxgen[cluster]' ({exc})"
        ) from exc
    from onnxgen.cli.progress import RichReporter
    from onnxgen.convert.default import resolve_model_path

    path = resolve_model_path(args.model, progress=RichReporter())  # the default model is built here, once
    threads = args.threads or (
        max(1, (os.cpu_count() or 1) // args.replicas) if args.device == "cpu" else None
    )
    load = {
        "backend": args.backend,
        "device": args.device,
        "chunk_size": args.prefill_chunk,
        "max_sessions": args.max_sessions,
        **({"threads": threads} if threads else {}),
        **({"tool_parser": args.tool_parser} if args.tool_parser else {}),
        **({"kv_dir": str(Path(args.kv_dir))} if args.kv_dir else {}),
    }
    gpus = args.replica_gpus if args.replica_gpus is not None else replica_gpus(args.device, args.replicas)
    server = {
        f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "isolate_keyless"
    }
    cluster = ClusterConfig(
        replicas=args.replicas,
        num_gpus=gpus,
        mode=args.router,
        isolate_keyless=config.isolate_keyless,
        load=load,
        server={**server, "model_id": config.model_id or path.name},
    )
    print(
        f"onnxgen: serving {cluster.server['model_id']!r} from {args.replicas} replica(s) on "
        f"http://{args.host}:{args.port}/v1 · router {args.router} · Ray Serve (Ctrl-C stops)",
        file=sys.stderr,
    )
    run_local(
        str(path), cluster, host=args.host, port=args.port, progress=lambda line: print(line, file=sys.stderr)
    )
    return 0
