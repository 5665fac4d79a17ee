"""SGLang 0.5.23's own staging functions, loaded from the released wheel without importing sglang.

Importing ``sglang`` needs torch, triton and a GPU stack. The staging protocol's pure parts
(ring allocator, grid, head slicing, readiness rule, frame encoders and parsers) do not, so this
module reads their source out of the ``sglang==0.5.23`` wheel, keeps exactly the top-level
definitions the conformance checks need, and executes that code. Changes made to SGLang's code,
all as AST transforms checked against the expected shape:

* ``StagingAllocator.__init__`` loses its device buffer (the statements touching
  ``StagingBuffer`` / ``self.buffer`` and the pointer log line); the ring logic is untouched.
* ``prefetch_staging_reqs`` loses its function-local imports (zmq, NetworkAddress and SGLang's
  own ``staging_grid_tokens``); callers hand it sockets, so nothing else changes.
* A few methods of server classes (frame builders and parsers) are lifted out of their class and
  called with a stand-in ``self`` that carries only the attributes they read.

Where the wheel comes from (``wheel_path``):

* ``TWIN_SGLANG_WHEEL``: path of the wheel file, used as is (a missing file is an error, never
  a download).
* otherwise ``$TWIN_CACHE_DIR`` (default ``~/.cache/staging-twin``)/``sglang-0.5.23-*.whl``,
  downloaded there (about 40 MB, once) with ``pip download --no-deps sglang==0.5.23`` when
  missing, unless ``TWIN_OFFLINE=1``. A download is announced on stderr before it starts, and
  one that failed is not tried again in the same process.

Contracts: ``wheel_path()`` returns an existing file or raises ``ReferenceUnavailable`` with
the reason; ``load()`` returns SGLang's functions (memoised per wheel file, so pointing
``TWIN_SGLANG_WHEEL`` elsewhere takes effect at the next call) or raises
``ReferenceUnavailable`` when the wheel cannot be had or its code changed shape. Nothing here
imports pytest: the tests turn ``ReferenceUnavailable`` into a failure, or into a skip only
when ``TWIN_OFFLINE=1`` (``tests/conftest.py``, fixture ``sglang_reference``).
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
_PKG = "sglang/srt/disaggregation/common/"
STAGING_BUFFER = _PKG + "staging_buffer.py"
STAGING_HANDLER = _PKG + "staging_handler.py"
CONN = _PKG + "conn.py"
UTILS = "sglang/srt/disaggregation/utils.py"

# What each source file must provide: top-level names, and (class, method) pairs lifted out of
# classes that cannot be built without a server (their ``self`` is a stand-in).
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


# Functions whose body imports what callers provide instead: the imports are dropped and the
# names come from the namespace (staging_grid_tokens is SGLang's own, loaded above).
_LOCAL_IMPORTS = {"prefetch_staging_reqs": {"zmq", "staging_grid_tokens", "NetworkAddress"}}


class ReferenceUnavailable(RuntimeError):
    """The sglang wheel could not be found or downloaded, or its code changed shape."""


def cache_dir() -> Path:
    """Where a downloaded wheel is kept: ``$TWIN_CACHE_DIR`` or ``~/.cache/staging-twin``."""
    return Path(os.environ.get("TWIN_CACHE_DIR") or Path.home() / ".cache" / "staging-twin")


def offline() -> bool:
    """``TWIN_OFFLINE=1``: never download the wheel (and the tests skip without it)."""
    return os.environ.get("TWIN_OFFLINE") == "1"


def _cached_wheel(directory: Path) -> Path | None:
    found = sorted(directory.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    return found[0] if found else None


_FAILED_DOWNLOADS: dict[Path, str] = {}
"""Directories a download into failed in this process, with why (not tried again)."""


def say_on_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _download(directory: Path, note: Callable[[str], None]) -> Path:
    if directory in _FAILED_DOWNLOADS:
        raise ReferenceUnavailable(_FAILED_DOWNLOADS[directory] + " (not retried in this "
                                   "process)")
    note(f"staging-twin: downloading sglang=={SGLANG_VERSION} (about 40 MB, once) into "
         f"{directory}, to run SGLang's own staging code from it; set TWIN_SGLANG_WHEEL=<path> "
         f"to use a wheel you have, or TWIN_OFFLINE=1 to do without")
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
    reason = (f"could not download sglang=={SGLANG_VERSION} into {directory}. Provide it with "
              f"TWIN_SGLANG_WHEEL=<path>, put it in {directory}, or set TWIN_OFFLINE=1 to do "
              f"without.\n" + "\n".join(errors))
    _FAILED_DOWNLOADS[directory] = reason
    raise ReferenceUnavailable(reason)


def wheel_path(note: Callable[[str], None] = say_on_stderr) -> Path:
    """The wheel file: ``TWIN_SGLANG_WHEEL``, else the cached one, else downloaded (``note``
    says so first; on stderr by default). ``ReferenceUnavailable`` says why there is none."""
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
        raise ReferenceUnavailable(f"TWIN_OFFLINE=1 and no sglang-{SGLANG_VERSION}-*.whl in "
                                   f"{directory}")
    return _download(directory, note)


def read_sources(wheel: Path, paths: tuple[str, ...] | list[str]) -> dict[str, str]:
    """The text of ``paths`` inside ``wheel``; ``ReferenceUnavailable`` if it is not a usable
    sglang wheel."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            return {path: zf.read(path).decode("utf-8") for path in paths}
    except (OSError, zipfile.BadZipFile, KeyError) as exc:
        raise ReferenceUnavailable(f"{wheel}: not a usable sglang wheel: {exc}") from None


# --- source extraction ------------------------------------------------------------------------


def top_level(tree: ast.Module, name: str, path: str) -> ast.stmt:
    """The top-level function or class ``name`` of ``tree`` (the source at ``path``)."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return node
    raise ReferenceUnavailable(f"{path}: no top-level {name!r} in sglang {SGLANG_VERSION}")


def method_of(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    """Method ``name`` of the class definition ``cls``."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise ReferenceUnavailable(f"no {cls.name}.{name} in sglang {SGLANG_VERSION}")


class _DropImports(ast.NodeTransformer):
    """Replace function-local imports anywhere in a function by ``pass``; collects the names
    they bound."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def _drop(self, node: ast.Import | ast.ImportFrom) -> ast.AST:
        self.names.update(a.asname or a.name for a in node.names)
        return ast.copy_location(ast.Pass(), node)

    visit_Import = visit_ImportFrom = _drop  # noqa: N815


def strip_local_imports(fn: ast.FunctionDef, expected: set[str]) -> None:
    """Drop ``fn``'s function-local imports, refusing unless they bind exactly ``expected``
    (the caller's namespace provides those names)."""
    dropper = _DropImports()
    dropper.visit(fn)
    if dropper.names != expected:
        raise ReferenceUnavailable(f"{fn.name} imports changed: {sorted(dropper.names)}")


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
    init = method_of(cls, "__init__")
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


def _select(tree: ast.Module, path: str, top: list[str],
            methods: list[tuple[str, str]]) -> list[ast.stmt]:
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    chosen: list[ast.stmt] = []
    for name in top:
        node = top_level(tree, name, path)
        if name == "StagingAllocator":
            assert isinstance(node, ast.ClassDef)
            _strip_device_buffer(node)
        if name in _LOCAL_IMPORTS:
            assert isinstance(node, ast.FunctionDef)
            strip_local_imports(node, _LOCAL_IMPORTS[name])
        chosen.append(node)
    for cls_name, meth in methods:
        cls = classes.get(cls_name)
        if cls is None:
            raise ReferenceUnavailable(f"{path}: no class {cls_name} in sglang {SGLANG_VERSION}")
        fn = method_of(cls, meth)
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


def namespace(name: str) -> dict[str, Any]:
    """The module globals SGLang's staging code reads besides what each loader adds."""
    import dataclasses as dataclasses_mod
    from typing import Optional

    # SGLang's log lines (a released allocation, a timeout) go where the application's logging
    # sends them, and nowhere when it configured none (not to stderr by logging's last resort).
    logger = logging.getLogger(name)
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    # SGLang's code names typing.List/Tuple; with postponed annotations the builtins serve.
    return {
        "__name__": name,
        "threading": threading,
        "logging": logging,
        "logger": logger,
        "dataclasses": dataclasses_mod,
        "Optional": Optional,
        "List": list,
        "Tuple": tuple,
        "NetworkAddress": _NetworkAddress,
    }


def exec_definitions(module_name: str, path: str, source: str, body: list[ast.stmt],
                     extra: dict[str, Any], wheel: Path) -> dict[str, Any]:
    """Execute ``body`` (definitions taken from ``source``, the wheel's ``path``) as module
    ``module_name`` with ``namespace()`` plus ``extra`` as its globals; its dict. Tracebacks
    show the wheel's own lines."""
    module = types.ModuleType(module_name)
    module.__dict__.update(namespace(module_name))
    module.__dict__.update(extra)
    sys.modules[module_name] = module  # dataclasses resolves string annotations through it
    filename = f"{wheel.name}/{path}"
    # Line numbers are the wheel's; register the text so tracebacks show SGLang's lines.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    future = ast.parse("from __future__ import annotations").body
    code = compile(ast.Module(body=[*future, *body], type_ignores=[]), filename, "exec",
                   dont_inherit=True)
    exec(code, module.__dict__)
    return module.__dict__


def load(note: Callable[[str], None] = say_on_stderr) -> types.SimpleNamespace:
    """SGLang's staging functions and classes, executed from the wheel's source (memoised per
    wheel file). ``note`` hears of a download before it starts."""
    return load_wheel(wheel_path(note))


@functools.lru_cache(maxsize=4)
def load_wheel(wheel: Path) -> types.SimpleNamespace:
    """``load()`` from this wheel file."""
    sources = read_sources(wheel, list(_WANTED))
    out: dict[str, Any] = {}
    for path, (top, methods) in _WANTED.items():
        tree = ast.parse(sources[path], filename=path)
        body = _select(tree, path, top, methods)
        ns = exec_definitions("sglang_ref_" + Path(path).stem, path, sources[path], body, {
            "staging_grid_tokens": out.get("staging_grid_tokens"),
            "zmq": types.SimpleNamespace(),  # sockets are handed in; nothing may create one
        }, wheel)
        for name in top:
            out[name] = ns[name]
        for _, meth in methods:
            out[meth] = ns[meth]
    out["wheel"] = wheel
    return types.SimpleNamespace(**out)


# --- adapters: SGLang's call shapes -> plain values --------------------------------------------


def make_allocator(total_size_bytes: int) -> Any:
    """SGLang's ``StagingAllocator`` (device arguments are ignored by the stripped ``__init__``)."""
    return load().StagingAllocator(total_size_bytes, "cpu", 0)


@dataclass
class StagingState:
    """The two attributes of SGLang's ``PrefillStagingContext`` the watermark code reads."""

    remote_watermarks: dict[str, tuple[int, int]] = field(default_factory=dict)
    watermark_cv: threading.Condition = field(default_factory=threading.Condition)


def is_watermark_ready(watermark: tuple[int, int] | None, alloc_round: int,
                       alloc_end: int, session_id: str = "s") -> bool:
    """SGLang's readiness rule on one session's watermark (``None``: none received yet)."""
    state = StagingState()
    if watermark is not None:
        state.remote_watermarks[session_id] = watermark
    return bool(load().is_watermark_ready(state, session_id, alloc_round, alloc_end))


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
        self.arrived: list[tuple[Any, ...]] = []
        self._staging_handler = self

    def _prefill_unique_rank(self) -> int:
        return self.rank

    def _send_multipart_locked(self, _endpoint: str, parts: list[bytes], is_ipv6: bool) -> None:
        self.sent.append(list(parts))

    def handle_chunk_arrived(self, *args: Any) -> None:
        self.arrived.append(args)


def watermark_frames(wm_round: int, wm_tail: int, session_id: str) -> list[bytes]:
    """The WATERMARK frames SGLang's decode sends for this watermark."""
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


def parse_staging_rsp(frames: list[bytes], room: int,
                      session_id: str) -> tuple[Any, Any, Any] | None:
    """``(offsets, rounds, ends)`` SGLang records for ``room``/``session_id``, or None."""
    tinfo = types.SimpleNamespace(staging=None)
    load().handle_staging_rsp(frames, {room: {session_id: tinfo}})
    if tinfo.staging is None:
        return None
    return tinfo.staging.offsets, tinfo.staging.rounds, tinfo.staging.ends


def chunk_ready_frames(room: int, chunk_idx: int, page_start: int, num_pages: int,
                       writer_id: str, prefill_rank: int) -> list[bytes]:
    """The CHUNK_READY frames SGLang's prefill sends."""
    mgr = _Manager(prefill_rank)
    load().send_chunk_ready(mgr, room=room, chunk_idx=chunk_idx, page_start=page_start,
                            num_pages=num_pages, writer_id=writer_id, targets=[("h", 1)])
    (frames,) = mgr.sent
    return frames


def parse_chunk_ready(frames: list[bytes], room: int) -> list[tuple[Any, ...]]:
    """``handle_chunk_arrived`` calls SGLang's decode makes for ``frames`` (room registered)."""
    mgr = _Manager(rooms=(room,))
    load().handle_chunk_ready(mgr, frames)
    return mgr.arrived


def kv_status_frames(room: int, status: int, prefill_rank: int,
                     failure_reason: str | None) -> list[bytes]:
    """The KV_STATUS frames SGLang's prefill sends (NIXL's framing)."""
    return list(load()._encode_kv_status_message(
        _Manager(prefill_rank), bootstrap_room=room, status=status, failure_reason=failure_reason
    ))


def parse_kv_status(frames: list[bytes]) -> tuple[Any, ...] | None:
    """What SGLang's decode reads out of KV_STATUS frames, or None."""
    got = load().parse_kv_status_message(_Manager(), frames)
    return None if got is None else tuple(got)
