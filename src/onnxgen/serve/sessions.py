"""The server's session registry: session ids → engine sessions, scoped to API keys, bounded and expiring.

Ids are random 128-bit values (`secrets.token_hex(16)`). A session is visible only to the key that created
it (without keys, to anyone who knows its id). Its KV identity is salted with its tenant's salt
(`Session.salt`, chosen by the server: the key's id; without keys, none unless the server isolates keyless
callers, then the session's own id), so prefix reuse and `cached_tokens` never cross tenants.

Bounds: at most `max_per_owner` sessions per key, and without keys at most `max_per_client` per client
address, so one anonymous client cannot take every session; a session unused for `ttl_s` seconds expires
(swept when sessions are created or looked up: no thread). A request names its session in the
`X-Session-Id` header (`SESSION_HEADER`).

With a `kv_dir`, a session's context can be saved to a session file (`save`; every session holding one at
shutdown: `save_all`) named after its owner's hash and its id; a request naming an id the store does not hold
restores it from its file (`restore`, off the event loop: after a restart, or after it expired), under the
salt the server gives it, and the file goes when the session is deleted. A file that no longer fits (another
package or backend, corrupted) is logged and the session starts empty under its id: the client's next
request carries its conversation, which is then recomputed.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from onnxgen.errors import SessionFileError, SessionLimit

SESSION_HEADER = "X-Session-Id"
# the ASGI scope extension in which an ingress in front of the server names the session POST /v1/sessions makes
SESSION_EXTENSION = "onnxgen.session_id"
_SID = re.compile(r"[0-9a-f]{32}")
log = logging.getLogger("onnxgen.serve")

if TYPE_CHECKING:
    from onnxgen import Model, Session


@dataclass
class _Entry:
    owner: str  # the key id ("anonymous" without keys)
    client: str  # what the creation is counted against: the key id, or the client's address without keys
    session: Session
    used: float  # time.monotonic() of the last lookup


class SessionStore:
    """Thread-safe. `create(owner, client, salt)` → id; `get(owner, id)`; `remove(owner, id)`; `expired()`."""

    def __init__(
        self,
        model: Model,
        max_per_owner: int = 1024,
        max_per_client: int = 64,
        ttl_s: float = 3600.0,
        kv_dir: str | Path | None = None,
    ) -> None:
        self.model = model
        self.kv_dir = Path(kv_dir) if kv_dir is not None else None
        self.max_per_owner = max_per_owner
        self.max_per_client = max_per_client
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._sessions: dict[str, _Entry] = {}
        self._expired: list[Session] = []  # swept out, to be closed off the event loop (`expired`)

    def create(self, owner: str, client: str, salt: str | None, *, per_id_salt: bool = False) -> str:
        """A new session for `owner`, counted against `client`; its identity salt is `salt` (or its own id
        when `per_id_salt`). Raises `SessionLimit` (its message names the bound) when the owner or the client
        holds as many sessions as allowed."""
        with self._lock:
            sid = secrets.token_hex(16)
            self._add(owner, client, salt, per_id_salt, sid)
            return sid

    def adopt(
        self, owner: str, client: str, salt: str | None, sid: str, *, per_id_salt: bool = False
    ) -> Session | None:
        """The session `sid` of `owner`, created empty under that id if this store does not hold it (a
        session begun on another replica: its next request recomputes what that replica had cached). None
        when another owner holds `sid` or `sid` is not an id this store makes. Raises `SessionLimit` as
        `create` does."""
        if not self.well_formed(sid):
            return None
        with self._lock:
            hit = self._owned(owner, sid)
            if hit is None and sid not in self._sessions:
                hit = self._add(owner, client, salt, per_id_salt, sid)
            if hit is None:
                return None
            hit.used = time.monotonic()
            return hit.session

    def _add(self, owner: str, client: str, salt: str | None, per_id_salt: bool, sid: str) -> _Entry:
        """Register a new session `sid` (call with `_lock` held). Raises `SessionLimit`."""
        self._sweep()
        owned = sum(1 for e in self._sessions.values() if e.owner == owner)
        if owned >= self.max_per_owner:
            raise SessionLimit(f"this key holds {self.max_per_owner} sessions; delete some first")
        if client != owner and sum(1 for e in self._sessions.values() if e.client == client) >= (
            self.max_per_client
        ):
            raise SessionLimit(
                f"this client holds {self.max_per_client} sessions; delete some, or let them expire "
                f"({self.ttl_s:g} s unused)"
            )
        session = self.model.session(name=f"http-{sid[:8]}", salt=sid if per_id_salt else salt)
        entry = self._sessions[sid] = _Entry(owner, client, session, time.monotonic())
        return entry

    def _owned(self, owner: str, sid: str) -> _Entry | None:
        """The entry of `sid` if it exists, has not expired and belongs to `owner`; call with `_lock` held."""
        hit = self._sessions.get(sid)
        if hit is None or not secrets.compare_digest(hit.owner, owner):
            return None
        if time.monotonic() - hit.used > self.ttl_s:
            del self._sessions[sid]
            self._expired.append(hit.session)
            return None
        return hit

    def get(self, owner: str, sid: str) -> Session | None:
        """The session `sid` if it exists and belongs to `owner` (else None: indistinguishable); marks it used."""
        with self._lock:
            hit = self._owned(owner, sid)
            if hit is None:
                return None
            hit.used = time.monotonic()
            return hit.session

    def remove(self, owner: str, sid: str) -> Session | None:
        """Forget `sid` (if `owner` holds it) and return its Session for closing, else None."""
        with self._lock:
            hit = self._owned(owner, sid)
            if hit is None:
                return None
            del self._sessions[sid]
            return hit.session

    # --- session files ---------------------------------------------------------------------------------

    def file(self, owner: str, sid: str) -> Path | None:
        """Where `owner`'s session `sid` is saved (None without a kv_dir, or for an id this store never makes)."""
        if self.kv_dir is None or not _SID.fullmatch(sid):
            return None
        return self.kv_dir / f"{hashlib.sha256(owner.encode()).hexdigest()[:16]}-{sid}.onnxgen"

    def save(self, owner: str, sid: str) -> tuple[int, int] | None:
        """Save `owner`'s session `sid` to its file: (tokens, bytes), or None when the store holds no such
        session. Raises `InvalidRequest` when it retains no context. Blocks: call it off the event loop."""
        path = self.file(owner, sid)
        session = self.get(owner, sid)
        if session is None or path is None:
            return None
        size = session.save(path)
        return len(session.history), size

    def save_all(self) -> int:
        """Save every session that retains a context (at shutdown); returns how many were saved."""
        with self._lock:
            entries = list(self._sessions.items())
        saved = 0
        for sid, e in entries:
            path = self.file(e.owner, sid)
            if path is None or not e.session.retained_tokens:
                continue
            try:
                e.session.save(path)
                saved += 1
            except Exception:
                log.exception("could not save session %s", sid)
        return saved

    def restore(self, owner: str, sid: str, salt: str | None) -> Session | None:
        """The session `sid` of `owner` from its file, registered under its id (None: no file). A file that
        cannot be restored is logged and the session starts empty. Blocks: call it off the event loop."""
        path = self.file(owner, sid)
        if path is None or not path.is_file():
            return None
        try:
            session = self.model.restore_session(path, name=f"http-{sid[:8]}", salt=salt)
        except SessionFileError as exc:
            log.warning("session %s starts empty: %s", sid, exc)
            session = self.model.session(name=f"http-{sid[:8]}", salt=salt)
        with self._lock:
            hit = self._sessions.get(sid)
            if hit is not None:  # restored meanwhile by another request: keep that one
                session.close()
                return hit.session if secrets.compare_digest(hit.owner, owner) else None
            self._sessions[sid] = _Entry(owner, owner, session, time.monotonic())
        return session

    def forget_file(self, owner: str, sid: str) -> None:
        path = self.file(owner, sid)
        if path is not None:
            path.unlink(missing_ok=True)

    def _sweep(self) -> None:
        now = time.monotonic()
        for sid in [s for s, e in self._sessions.items() if now - e.used > self.ttl_s]:
            self._expired.append(self._sessions.pop(sid).session)

    def expired(self) -> list[Session]:
        """The sessions that expired since the last call (forgotten already; the caller closes them)."""
        with self._lock:
            self._sweep()
            out, self._expired = self._expired, []
            return out

    def ids(self) -> list[str]:
        """The ids of the sessions held now (expired ones may linger until the next sweep)."""
        with self._lock:
            return list(self._sessions)

    @staticmethod
    def well_formed(sid: str) -> bool:
        """Whether `sid` has the shape of the ids this store makes."""
        return _SID.fullmatch(sid) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)
