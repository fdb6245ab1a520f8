"""What a request is routed by: `RouteKey`, read off its path, headers and body by the ingress, with no tokenizer.

    session   digest of the session id (`X-Session-Id`, or the id in /v1/sessions/{id}/...; for POST /v1/sessions
              the id the ingress gives the new session): the request must reach the replica that holds it
    prefixes  chained digests of the prompt's canonical text in blocks of `block_chars` characters, salted with
              the tenant (API key's hash, `cache_salt`): a replica that ran a request whose text began with the
              same blocks holds their KV under the same salt

The prompt's canonical text is the JSON of what a template renders from (tools, system, messages or input
items; a completion's prompt) with sorted keys, so a conversation that is resent with one more turn begins with
the same text as before, and so with the same blocks, up to the block the previous request ended in. Blocks
of characters stand in for pages of tokens: the router cannot tokenize (that is each replica's preparation),
and a block shared by two requests almost always means tokens shared by them.

Digests are 64-bit blake2b in hex: compact in routing stats, and a session id (a bearer secret without API
keys) never leaves the ingress and its replica in the clear. Everything here is pure and never raises on a
malformed request: a body that is not JSON or names no prompt routes by load (cf. ray#64326, where a router
that raised on an unexpected body hung every request).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BLOCK_CHARS = 256  # characters per prefix block (a few dozen tokens)
MAX_BLOCKS = 256  # blocks of one prompt that are digested (its first 64 KiB of canonical text)
MAX_ROUTED_BODY = 8 * 1024 * 1024  # larger bodies are not parsed for routing (the replica answers 413)
_SESSION_PATH = re.compile(r"/v1/sessions/([^/]+)")
_PROMPT_FIELDS = ("tools", "system", "instructions", "messages", "input", "prompt")


@dataclass(frozen=True)
class RouteKey:
    """A request's routing facts: `session` (a digest, or None), `prefixes` (chained block digests, first
    block first; empty: nothing to match)."""

    session: str | None = None
    prefixes: tuple[str, ...] = ()


def digest(text: str) -> str:
    """64-bit blake2b of `text`, in hex."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def session_digest(sid: str) -> str:
    """The digest a session id is routed and published by."""
    return digest("session|" + sid.strip())


def tenant(headers: Mapping[str, str], body_salt: str | None, isolate_keyless: bool = False) -> str | None:
    """The tenant a stateless request's prefixes are salted with, as the server salts its KV: the presented
    API key's hash, narrowed by the request's `cache_salt` (body, else `X-Cache-Salt`). None: the request
    shares nothing (keyless and unsalted while the server isolates keyless callers). `headers` are lowercase."""
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    key = (
        token.strip()
        if scheme.lower() == "bearer" and token.strip()
        else headers.get("x-api-key", "").strip()
    )
    salt = body_salt if isinstance(body_salt, str) else headers.get("x-cache-salt")
    if not key and salt is None and isolate_keyless:
        return None
    key_id = hashlib.sha256(key.encode()).hexdigest() if key else "-"
    return f"{key_id}|{salt if salt is not None else ''}"


def prompt_text(doc: Any) -> str | None:
    """The canonical text of the prompt a request body names (None: it names none)."""
    if not isinstance(doc, dict):
        return None
    parts = {k: doc[k] for k in _PROMPT_FIELDS if k in doc}
    if not any(k in parts for k in ("messages", "input", "prompt")):
        return None
    return json.dumps(parts, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def prefix_digests(
    salt: str, text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS
) -> tuple[str, ...]:
    """Chained digests of the full `block_chars` blocks of `text` under `salt`: entry i covers text[: (i+1) *
    block_chars], so two texts share entry i exactly when they share that whole prefix (and the salt)."""
    assert block_chars > 0 and max_blocks >= 0
    out: list[str] = []
    h = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8)
    for i in range(min(len(text) // block_chars, max_blocks)):
        h.update(text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass"))
        out.append(h.copy().hexdigest())
    return tuple(out)


def creates_session(method: str, path: str) -> bool:
    """Whether the request is `POST /v1/sessions`."""
    return method == "POST" and path.rstrip("/") == "/v1/sessions"


def route_key(
    method: str,
    path: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    isolate_keyless: bool = False,
    block_chars: int = BLOCK_CHARS,
    max_blocks: int = MAX_BLOCKS,
) -> RouteKey:
    """The `RouteKey` of one HTTP request (`headers` lowercase). Never raises."""
    if creates_session(method, path):  # the ingress names the new session (`bridge.read_call`)
        return RouteKey()
    sid = headers.get("x-session-id")
    m = _SESSION_PATH.match(path)
    if m is not None:
        sid = m.group(1)
    session = session_digest(sid) if sid and sid.strip() else None
    if not body or len(body) > MAX_ROUTED_BODY:
        return RouteKey(session)
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return RouteKey(session)
    text = prompt_text(doc)
    salt = tenant(headers, doc.get("cache_salt"), isolate_keyless) if text is not None else None
    if text is None or salt is None:
        return RouteKey(session)
    return RouteKey(session, prefix_digests(salt, text, block_chars, max_blocks))
