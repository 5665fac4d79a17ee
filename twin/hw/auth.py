"""Who may talk to a hardware run: one random key per run, proved by CurveZMQ on every socket.

SGLang authenticates nothing on its ZMQ sockets; the twin does (docs/hardware.md, "Security
model"). Each run makes a :class:`RunKey`: a CurveZMQ secret key (32 random bytes, Z85 text)
and the public key derived from it. Every process of the run holds the same key pair:

* every PULL socket of the run (the coordinator's, each rank's, each agent's) is a CURVE
  server with that key and a ZAP handler (:func:`guard_context`) that admits exactly one client
  key, the run's own public key;
* every PUSH socket is a CURVE client with the run's key pair and the run's public key as the
  server key.

A process that lacks the secret cannot finish the handshake, so none of its frames reaches
the run's code: pickle payloads, garbage and forged SGLang frames alike are refused at the
socket, counted (:class:`RefusalCounter`) and reported. Traffic is also encrypted.

How the key travels: local ranks get it inside their start-up spec (through the
``multiprocessing`` fork server's private socket, never a command line); agents on other nodes
read it from ``TWIN_RUN_SECRET`` or from the file ``TWIN_RUN_SECRET_FILE`` names
(:func:`key_from_env`), which the coordinator writes with mode 0600 (:func:`write_key_file`).
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth.thread
from zmq.utils.monitor import recv_monitor_message

SECRET_ENV = "TWIN_RUN_SECRET"
"""Environment variable holding a run's secret key (Z85 text, 40 characters)."""
SECRET_FILE_ENV = "TWIN_RUN_SECRET_FILE"
"""Environment variable naming a file that holds a run's secret key."""
Z85_KEY_LEN = 40

_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class AuthError(ValueError):
    """A run secret that is missing, unreadable or malformed (bad input: names its source)."""


@dataclass(frozen=True)
class RunKey:
    """A run's CurveZMQ key pair (Z85 text). ``secret`` is the only thing to keep secret; the
    public key is derived from it."""

    secret: bytes
    public: bytes

    def __repr__(self) -> str:  # never print the secret by accident
        return f"RunKey(public={self.public.decode()!r})"

    @classmethod
    def new(cls) -> RunKey:
        public, secret = zmq.curve_keypair()
        return cls(secret=secret, public=public)

    @classmethod
    def from_text(cls, text: str | bytes, source: str) -> RunKey:
        """The key whose secret is ``text`` (surrounding whitespace ignored); ``AuthError``
        naming ``source`` if it is not a 40-character Z85 key."""
        raw = text.encode("ascii", "replace") if isinstance(text, str) else bytes(text)
        raw = raw.strip()
        if len(raw) != Z85_KEY_LEN:
            raise AuthError(f"{source}: a run secret is {Z85_KEY_LEN} characters of Z85 text "
                            f"(got {len(raw)})")
        try:
            public = zmq.curve_public(raw)
        except (zmq.ZMQError, ValueError) as exc:
            raise AuthError(f"{source}: not a run secret (Z85 text): {exc}") from None
        return cls(secret=raw, public=public)

    def serve(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` (before it binds) a CURVE server with this key."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def join(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` (before it connects) a CURVE client of servers holding this key."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.public


def key_from_env(environ: Mapping[str, str] | None = None) -> RunKey | None:
    """The run key from ``TWIN_RUN_SECRET`` or the file ``TWIN_RUN_SECRET_FILE`` names;
    ``None`` when neither is set. ``AuthError`` for a key that is malformed or a file that
    cannot be read, or is readable by other users."""
    env = os.environ if environ is None else environ
    text = env.get(SECRET_ENV)
    if text:
        return RunKey.from_text(text, SECRET_ENV)
    path = env.get(SECRET_FILE_ENV)
    if not path:
        return None
    try:
        mode = os.stat(path).st_mode
        data = Path(path).read_bytes()[:4096]
    except OSError as exc:
        raise AuthError(f"{SECRET_FILE_ENV}={path}: cannot read it ({exc.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthError(f"{SECRET_FILE_ENV}={path}: other users can read it (mode "
                        f"{stat.S_IMODE(mode):o}); chmod 600 it")
    return RunKey.from_text(data, path)


def write_key_file(key: RunKey, path: str | os.PathLike[str]) -> Path:
    """Write ``key``'s secret to ``path`` (created with mode 0600, replaced if it exists)."""
    p = Path(path)
    with contextlib.suppress(FileNotFoundError):
        p.unlink()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.secret + b"\n")
    return p


class _OnlyRunKey:
    """ZAP credentials: admit the run's own public key, nothing else."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


_guards: weakref.WeakKeyDictionary[Any, zmq.auth.thread.ThreadAuthenticator] = (
    weakref.WeakKeyDictionary())
_guards_lock = threading.Lock()


def guard_context(ctx: zmq.Context[Any], key: RunKey) -> None:
    """Start (once per context) the ZAP handler that admits only ``key``'s clients."""
    with _guards_lock:
        if ctx in _guards:
            return
        auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=_QuietLog())
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=_OnlyRunKey(key.public))
        _guards[ctx] = auth


def unguard_context(ctx: zmq.Context[Any]) -> None:
    """Stop ``ctx``'s ZAP handler (before the context is terminated). Idempotent."""
    with _guards_lock:
        auth = _guards.pop(ctx, None)
    if auth is not None:
        auth.stop()


class _QuietLog:
    """pyzmq's authenticator logs every refusal; the run counts them instead."""

    def debug(self, *args: Any, **kw: Any) -> None: ...
    info = warning = error = exception = debug


class RefusalCounter:
    """Counts the handshakes a server socket refused (peers without the run key), read from a
    monitor socket. ``poll()`` drains the events seen so far and returns the running total."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self._mon: zmq.Socket[Any] | None = sock.get_monitor_socket(_FAILED)
        self._sock = sock
        self.refused = 0

    def poll(self) -> int:
        mon = self._mon
        if mon is None:
            return self.refused
        try:
            while mon.poll(0):
                event = recv_monitor_message(mon)
                if event["event"] & _FAILED:
                    self.refused += 1
        except zmq.ZMQError:
            pass
        return self.refused

    def close(self) -> None:
        if self._mon is None:
            return
        self.poll()
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._mon.close(0)
        self._mon = None
