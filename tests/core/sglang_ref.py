"""SGLang 0.5.23's own staging functions, loaded from the released wheel without importing sglang.

Importing ``sglang`` needs torch, triton and a GPU stack. The staging protocol's pure parts
(ring allocator, grid, head slicing, readiness rule, frame encoders and parsers) do not, so this
module reads their source out of the ``sglang==0.5.23`` wheel, keeps exactly the top-level
definitions the conformance tests need, and executes that code. Changes made to SGLang's code,
all as AST transforms checked against the expected shape:

* ``StagingAllocator.__init__`` loses its device buffer (the statements touching
  ``StagingBuffer`` / ``self.buffer`` and the pointer log line); the ring logic is untouched.
* ``prefetch_staging_reqs`` loses its function-local imports (zmq, NetworkAddress and SGLang's
  own ``staging_grid_tokens``); the tests hand it sockets, so nothing else changes.
* A few methods of server classes (frame builders and parsers) are lifted out of their class and
  called with a stand-in ``self`` that carries only the attributes they read.

Where the wheel comes from:

* ``TWIN_SGLANG_WHEEL``: path of the wheel file, used as is.
* otherwise ``$TWIN_CACHE_DIR`` (default ``~/.cache/staging-twin``)/``sglang-0.5.23-*.whl``,
  downloaded there (about 40 MB, once) with ``pip download --no-deps sglang==0.5.23`` when
  missing.

When the wheel cannot be had, ``load()`` raises ``ReferenceUnavailable``; the tests turn that
into a failure, or into a skip only when ``TWIN_OFFLINE=1`` is set.
"""

from __future__ import annotations

import ast
import functools
import linecache
import logging
import os
import subprocess
import sys
import threading
import types
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
_PKG = "sglang/srt/disaggregation/common/"
STAGING_BUFFER = _PKG + "staging_buffer.py"
STAGING_HANDLER = _PKG + "staging_handler.py"
CONN = _PKG + "conn.py"

# What each source file must provide: top-level names, and (class, method) pairs lifted out of
# classes that cannot be built without a server (their ``self`` is a stand-in in the tests).
_WANTED: dict[str, tuple[list[str], list[tuple[str, str]]]] = {
    STAGING_BUFFER: (
        [
            "StagingAllocator",
            "compute_head_slice_params",
            "compute_staging_layout",
            "staging_grid_tokens",
            "compute_grid_segments",
        ],
        [],
    ),
    STAGING_HANDLER: (
        ["is_watermark_ready", "handle_watermark_msg", "handle_staging_rsp",
         "StagingTransferInfo", "prefetch_staging_reqs"],
        [("DecodeStagingHandler", "_send_watermark")],
    ),
    CONN: (
        [],
        [
            ("CommonKVManager", "_encode_kv_status_message"),
            ("CommonKVManager", "parse_kv_status_message"),
            ("CommonKVManager", "send_chunk_ready"),
            ("CommonKVManager", "handle_chunk_ready"),
        ],
    ),
}


# Functions whose body imports what the tests provide instead: the imports are dropped and the
# names come from the namespace (staging_grid_tokens is SGLang's own, loaded above).
_LOCAL_IMPORTS = {"prefetch_staging_reqs": {"zmq", "staging_grid_tokens", "NetworkAddress"}}


class ReferenceUnavailable(RuntimeError):
    """The sglang wheel could not be found or downloaded."""


def cache_dir() -> Path:
    return Path(os.environ.get("TWIN_CACHE_DIR") or Path.home() / ".cache" / "staging-twin")


def _cached_wheel(directory: Path) -> Path | None:
    found = sorted(directory.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    return found[0] if found else None


def _download(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
            f"sglang=={SGLANG_VERSION}", "-d", str(directory)]
    attempts = [
        base,
        # The release is a CPython 3.11 manylinux wheel; fetch that one from other interpreters.
        [*base, "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
         "--abi", "cp311", "--platform", "manylinux_2_34_x86_64"],
    ]
    errors = []
    for cmd in attempts:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            output = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:
            output = "timed out after 900 s"
        wheel = _cached_wheel(directory)
        if wheel is not None:
            return wheel
        errors.append(f"$ {' '.join(cmd[2:])}\n{output[-1500:]}")
    raise ReferenceUnavailable(
        f"could not download sglang=={SGLANG_VERSION} into {directory}; the conformance tests "
        f"run SGLang's own code from that wheel. Provide it with TWIN_SGLANG_WHEEL=<path>, put "
        f"it in {directory}, or set TWIN_OFFLINE=1 to skip these tests.\n" + "\n".join(errors)
    )


def offline() -> bool:
    return os.environ.get("TWIN_OFFLINE") == "1"


def wheel_path() -> Path:
    env = os.environ.get("TWIN_SGLANG_WHEEL")
    if env:
        p = Path(env)
        if not p.is_file():
            raise ReferenceUnavailable(f"TWIN_SGLANG_WHEEL={env}: no such file")
        return p
    directory = cache_dir()
    wheel = _cached_wheel(directory)
    if wheel is not None:
        return wheel
    if offline():
        raise ReferenceUnavailable(f"no sglang-{SGLANG_VERSION}-*.whl in {directory}")
    return _download(directory)


# --- source extraction ------------------------------------------------------------------------


def _mentions(node: ast.AST, names: set[str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in names:
            return True
        if (isinstance(sub, ast.Attribute) and sub.attr in names
                and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
            return True
    return False


def _strip_device_buffer(cls: ast.ClassDef) -> None:
    """Drop the device buffer from ``StagingAllocator.__init__``; the ring logic is untouched."""
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    device_names = {"StagingBuffer", "buffer", "_device_ptr_type_str", "ptr_type_str"}
    kept = [s for s in init.body if not _mentions(s, device_names)]
    dropped = len(init.body) - len(kept)
    # self.buffer = StagingBuffer(..); self.base_ptr = self.buffer.data_ptr;
    # ptr_type_str = _device_ptr_type_str(..); logger.info(..ptr_type_str..)
    if dropped != 4:
        raise ReferenceUnavailable(
            f"StagingAllocator.__init__ changed shape: dropped {dropped} statements, expected 4"
        )
    kept.append(ast.parse("self.base_ptr = 0").body[0])
    init.body = kept


def _strip_local_imports(fn: ast.FunctionDef, expected: set[str]) -> None:
    imports = [s for s in fn.body if isinstance(s, (ast.Import, ast.ImportFrom))]
    names = {(a.asname or a.name) for s in imports for a in s.names}
    if names != expected:
        raise ReferenceUnavailable(f"{fn.name} imports changed: {sorted(names)}")
    fn.body = [s for s in fn.body if s not in imports]


def _select(tree: ast.Module, path: str, top: list[str], methods: list[tuple[str, str]]):
    by_name: dict[str, ast.stmt] = {}
    classes: dict[str, ast.ClassDef] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            by_name[node.name] = node
        if isinstance(node, ast.ClassDef):
            classes[node.name] = node
    chosen: list[ast.stmt] = []
    for name in top:
        if name not in by_name:
            raise ReferenceUnavailable(f"{path}: no top-level {name!r} in sglang {SGLANG_VERSION}")
        node = by_name[name]
        if name == "StagingAllocator":
            _strip_device_buffer(node)  # type: ignore[arg-type]
        if name in _LOCAL_IMPORTS:
            _strip_local_imports(node, _LOCAL_IMPORTS[name])  # type: ignore[arg-type]
        chosen.append(node)
    for cls_name, meth in methods:
        cls = classes.get(cls_name)
        fn = next((n for n in (cls.body if cls else []) if isinstance(n, ast.FunctionDef)
                   and n.name == meth), None)
        if fn is None:
            raise ReferenceUnavailable(f"{path}: no {cls_name}.{meth} in sglang {SGLANG_VERSION}")
        fn.decorator_list = [d for d in fn.decorator_list
                             if not (isinstance(d, ast.Name) and d.id == "staticmethod")]
        chosen.append(fn)
    return chosen


class _NetworkAddress:
    """Stand-in for ``sglang.srt.utils.network.NetworkAddress`` (only what the senders use)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port, self.is_ipv6 = host, port, False

    def to_tcp(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def to_host_port_str(self) -> str:
        return f"{self.host}:{self.port}"


def _namespace(name: str) -> dict[str, Any]:
    import dataclasses as dataclasses_mod
    from typing import Optional

    # SGLang's code names typing.List/Tuple; with postponed annotations the builtins serve.
    return {
        "__name__": name,
        "threading": threading,
        "logging": logging,
        "logger": logging.getLogger(name),
        "dataclasses": dataclasses_mod,
        "Optional": Optional,
        "List": list,
        "Tuple": tuple,
        "NetworkAddress": _NetworkAddress,
    }


@functools.lru_cache(maxsize=1)
def load() -> types.SimpleNamespace:
    """SGLang's staging functions and classes, executed from the wheel's source."""
    wheel = wheel_path()
    try:
        with zipfile.ZipFile(wheel) as zf:
            sources = {path: zf.read(path).decode("utf-8") for path in _WANTED}
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ReferenceUnavailable(f"{wheel}: not a usable sglang wheel: {exc}") from None
    out: dict[str, Any] = {}
    for path, (top, methods) in _WANTED.items():
        tree = ast.parse(sources[path], filename=path)
        body = [node for node in tree.body if isinstance(node, ast.ImportFrom)
                and node.module == "__future__"]
        body += _select(tree, path, top, methods)
        module_name = "sglang_ref_" + Path(path).stem
        module = types.ModuleType(module_name)
        module.__dict__.update(_namespace(module_name))
        module.__dict__.update(
            staging_grid_tokens=out.get("staging_grid_tokens"),
            zmq=types.SimpleNamespace(),  # sockets are handed in; nothing may create one
        )
        sys.modules[module_name] = module  # dataclasses resolves string annotations through it
        filename = f"{wheel.name}/{path}"
        src = sources[path]
        # Line numbers are the wheel's; register the text so tracebacks show SGLang's lines.
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        code = compile(ast.Module(body=body, type_ignores=[]), filename, "exec",
                       dont_inherit=True)
        exec(code, module.__dict__)
        for name in top:
            out[name] = module.__dict__[name]
        for _, meth in methods:
            out[meth] = module.__dict__[meth]
    out["wheel"] = wheel
    return types.SimpleNamespace(**out)


# --- adapters: SGLang's call shapes -> plain values --------------------------------------------


def make_allocator(total_size_bytes: int) -> Any:
    """SGLang's ``StagingAllocator`` (device arguments are ignored by the stripped ``__init__``)."""
    return load().StagingAllocator(total_size_bytes, "cpu", 0)


@dataclass
class StagingState:
    """The two attributes of SGLang's ``PrefillStagingContext`` the watermark code reads."""

    remote_watermarks: dict = field(default_factory=dict)
    watermark_cv: threading.Condition = field(default_factory=threading.Condition)


def is_watermark_ready(watermark: tuple[int, int] | None, alloc_round: int,
                       alloc_end: int, session_id: str = "s") -> bool:
    """SGLang's readiness rule on one session's watermark (``None``: none received yet)."""
    state = StagingState()
    if watermark is not None:
        state.remote_watermarks[session_id] = watermark
    return load().is_watermark_ready(state, session_id, alloc_round, alloc_end)


class _Socket:
    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, parts: list[bytes]) -> None:
        self.sent.append(list(parts))


class _Receiver:
    """Stand-in decode receiver: one bootstrap connection whose socket records frames."""

    def __init__(self) -> None:
        self.bootstrap_infos = [{"pp_rank": 0}]
        self.sock = _Socket()

    def _connect_to_bootstrap_server(self, _info: Any) -> tuple[_Socket, threading.Lock]:
        return self.sock, threading.Lock()


class _Manager:
    """Stand-in ``CommonKVManager`` with NIXL's status framing (tag + reason)."""

    kv_status_msg_tag = b"KV_STATUS"
    kv_status_msg_carries_reason = True

    def __init__(self, prefill_rank: int = 0, rooms: tuple[int, ...] = ()) -> None:
        self.rank = prefill_rank
        self.sent: list[list[bytes]] = []
        self.request_status = dict.fromkeys(rooms, 0)
        self.arrived: list[tuple] = []
        self._staging_handler = self

    def _prefill_unique_rank(self) -> int:
        return self.rank

    def _send_multipart_locked(self, _endpoint: str, parts: list[bytes], is_ipv6: bool) -> None:
        self.sent.append(list(parts))

    def handle_chunk_arrived(self, *args: Any) -> None:
        self.arrived.append(args)


def watermark_frames(wm_round: int, wm_tail: int, session_id: str) -> list[bytes]:
    receiver = _Receiver()
    load()._send_watermark(receiver, session_id, (wm_round, wm_tail))
    (frames,) = receiver.sock.sent
    return frames


def prefetch_frames(room: int, session_pages: dict[str, int], chunked_prefill_size: int | None,
                    page_size: int, pp_rank: int | None = None) -> list[list[bytes]]:
    """STAGING_REQ frames SGLang's prefill prefetch sends for sessions with these page counts."""
    sock = _Socket()
    infos = {
        sid: types.SimpleNamespace(is_dummy=False, dst_kv_indices=range(pages), endpoint="h",
                                   dst_port=1)
        for sid, pages in session_pages.items()
    }
    load().prefetch_staging_reqs(
        room, {room: infos}, {"page_size": page_size}, chunked_prefill_size, set(),
        {"tcp://h:1": sock}, pp_rank,
    )
    return sock.sent


def parse_watermark(frames: list[bytes]) -> dict[str, tuple[int, int]]:
    """``remote_watermarks`` after SGLang's prefill handles ``frames`` from a fresh state."""
    state = StagingState()
    load().handle_watermark_msg(state, frames)
    return state.remote_watermarks


def parse_staging_rsp(frames: list[bytes], room: int, session_id: str) -> tuple | None:
    """``(offsets, rounds, ends)`` SGLang records for ``room``/``session_id``, or None."""
    tinfo = types.SimpleNamespace(staging=None)
    load().handle_staging_rsp(frames, {room: {session_id: tinfo}})
    if tinfo.staging is None:
        return None
    return tinfo.staging.offsets, tinfo.staging.rounds, tinfo.staging.ends


def chunk_ready_frames(room: int, chunk_idx: int, page_start: int, num_pages: int,
                       writer_id: str, prefill_rank: int) -> list[bytes]:
    mgr = _Manager(prefill_rank)
    load().send_chunk_ready(mgr, room=room, chunk_idx=chunk_idx, page_start=page_start,
                            num_pages=num_pages, writer_id=writer_id, targets=[("h", 1)])
    (frames,) = mgr.sent
    return frames


def parse_chunk_ready(frames: list[bytes], room: int) -> list[tuple]:
    """``handle_chunk_arrived`` calls SGLang's decode makes for ``frames`` (room registered)."""
    mgr = _Manager(rooms=(room,))
    load().handle_chunk_ready(mgr, frames)
    return mgr.arrived


def kv_status_frames(room: int, status: int, prefill_rank: int,
                     failure_reason: str | None) -> list[bytes]:
    return load()._encode_kv_status_message(
        _Manager(prefill_rank), bootstrap_room=room, status=status, failure_reason=failure_reason
    )


def parse_kv_status(frames: list[bytes]) -> tuple | None:
    return load().parse_kv_status_message(_Manager(), frames)


def require() -> types.SimpleNamespace:
    """``load()`` for tests: fail with the reason, or skip when ``TWIN_OFFLINE=1``."""
    import pytest

    try:
        return load()
    except ReferenceUnavailable as exc:
        problem = str(exc)
    if offline():
        pytest.skip(f"TWIN_OFFLINE=1: SGLang reference unavailable: {problem}")
    pytest.fail(problem, pytrace=False)
