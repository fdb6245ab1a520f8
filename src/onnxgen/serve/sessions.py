"""The server's session registry: session ids → engine sessions, scoped to API keys.

Ids are random 128-bit values (`secrets.token_hex(16)`). A session is visible only to the key that
created it; each key has its own default session (for requests without `X-Session-Id`). Every session's
identity is salted with its key (`Session.salt`), so KV, and therefore prefix reuse and `cached_tokens`,
never crosses keys: sessions of one key share the pages of common prefixes (one system prompt, many
agents), sessions of different keys share nothing. Without keys every caller is "anonymous" and nobody
can be told apart, so each session gets a salt of its own (its id): keyless sessions share nothing. A
request names its session in the `X-Session-Id` header (`SESSION_HEADER`).
"""

from __future__ import annotations

import secrets
import threading
from typing import TYPE_CHECKING

from onnxgen.errors import SessionLimit

SESSION_HEADER = "X-Session-Id"

if TYPE_CHECKING:
    from onnxgen import Model, Session


class SessionStore:
    def __init__(self, model: Model, max_per_key: int = 1024, keyed: bool = True) -> None:
        """`keyed`: callers are told apart by API keys (sessions are salted with their key), else every
        session is salted with its own id."""
        self.model = model
        self.keyed = keyed
        self.max_per_key = max_per_key
        self._lock = threading.Lock()
        self._sessions: dict[str, tuple[str, Session]] = {}  # id -> (owner key id, Session)
        self._defaults: dict[str, Session] = {}  # owner key id -> Session
        self._per_key: dict[str, int] = {}

    def create(self, owner: str) -> str:
        with self._lock:
            if self._per_key.get(owner, 0) >= self.max_per_key:
                raise SessionLimit()
            sid = secrets.token_hex(16)
            salt = owner if self.keyed else sid
            self._sessions[sid] = (owner, self.model.session(name=f"http-{sid[:8]}", salt=salt))
            self._per_key[owner] = self._per_key.get(owner, 0) + 1
            return sid

    def _owned(self, owner: str, sid: str) -> Session | None:
        """The session `sid` if it exists and belongs to `owner`; call with `_lock` held."""
        hit = self._sessions.get(sid)
        if hit is None or not secrets.compare_digest(hit[0], owner):
            return None
        return hit[1]

    def get(self, owner: str, sid: str) -> Session | None:
        """The session `sid` if it exists and belongs to `owner` (else None: indistinguishable)."""
        with self._lock:
            return self._owned(owner, sid)

    def default(self, owner: str) -> Session:
        with self._lock:
            s = self._defaults.get(owner)
            if s is None:
                s = self._defaults[owner] = self.model.session(name=f"default-{owner[:8]}", salt=owner)
            return s

    def remove(self, owner: str, sid: str) -> Session | None:
        """Forget `sid` (if `owner` holds it) and return its Session for closing, else None."""
        with self._lock:
            session = self._owned(owner, sid)
            if session is not None:
                del self._sessions[sid]
                self._per_key[owner] -= 1
            return session

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions) + len(self._defaults)
