"""A narrow, typed, lock-protected wrapper over ``nixl._api.nixl_agent``: only the calls kvshuttle uses.

NIXL has no type stubs and its agent is not thread-safe in the default sync mode, so every call goes
through one ``RLock`` here (no call here waits on a peer: NIXL posts and polls, UCX connects lazily). The
wrapper also counts live registrations, prepared lists and transfer handles (``counts()``) so tests can prove
nothing leaks, keeps handles that NIXL refused to release to retry them later instead of dropping them, and
keeps a remote agent loaded while a request to it may still be in flight (NIXL stops reporting on a request
whose remote agent was removed, so the quarantine could never learn that it ended).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from .errors import NixlUnavailableError

log = logging.getLogger(__name__)
XferState = Literal["DONE", "PROC", "ERR"]
MemType = Literal["DRAM", "VRAM"]
Descriptors = npt.NDArray[np.uint64]


class NixlCallError(Exception):
    """A NIXL call failed. ``disconnected`` is True when NIXL says the remote agent went away."""

    def __init__(self, call: str, exc: BaseException) -> None:
        name = type(exc).__name__
        self.disconnected = "RemoteDisconnect" in name or "REMOTE_DISCONNECT" in str(exc)
        self.nixl_error = name
        super().__init__(f"NIXL {call} failed: {name}: {exc}")


_construct_lock = threading.Lock()


def _load() -> tuple[Any, Any, Any]:
    try:
        from nixl import _api  # type: ignore[import-untyped]
    except ImportError as exc:
        raise NixlUnavailableError(
            f"cannot import NIXL ({exc}); install the transfer extra: pip install 'kvshuttle[transfer]' "
            "(nixl==1.5.1 nixl-cu13==1.5.1; install torch or use --no-deps first, see the README)"
        ) from exc
    if not os.environ.get("NIXL_LOG_LEVEL"):  # nixl logs INFO lines to stdout per agent; keep stdout clean
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return _api, _api.nixl_agent, _api.nixl_agent_config


class _DelayedBindings:
    """Stands in for ``nixl._api.nixlBind`` while one agent is built, to set the progress-thread delay.

    nixl's Python API hard-codes ``pthrDelay = 0``, which makes the UCX progress thread poll() with a zero
    timeout: one busy core per agent. The thread sleeps on the worker's event fd, so a delay only bounds
    how often it wakes without events: at 0 an idle agent keeps a whole core busy.
    """

    def __init__(self, real: Any, delay_us: int) -> None:
        self._real, self._delay_us = real, delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


def _make_agent(name: str, config: Any, delay_us: int) -> Any:
    api, agent_cls, _ = _load()
    real = getattr(api, "nixlBind", None)
    if real is None or delay_us <= 0:
        return agent_cls(name, config)
    with _construct_lock:
        api.nixlBind = _DelayedBindings(real, delay_us)
        try:
            return agent_cls(name, config)
        finally:
            api.nixlBind = real


@dataclass(eq=False)
class _NixlObject:
    """An opaque NIXL object and whether it has been released (compared by identity)."""

    raw: Any
    released: bool = False


class NixlRegistration(_NixlObject):
    """Registered memory (``register_memory``)."""


@dataclass(eq=False)
class NixlDescList(_NixlObject):
    """A prepared descriptor list (``prep_xfer_dlist``); ``remote``: the remote agent's name, None for local."""

    remote: str | None = None


@dataclass(eq=False)
class NixlXfer(_NixlObject):
    """A transfer request (``initialize_xfer`` / ``make_prepped_xfer``) to remote agent ``remote``."""

    remote: str = ""


def mem_type_of(device: str) -> tuple[MemType, int]:
    """NIXL memory type and device id of memory on ``device`` ("cpu", "cuda", "cuda:3")."""
    if device.startswith("cuda"):
        return "VRAM", int(device.partition(":")[2] or 0)
    return "DRAM", 0


@dataclass(frozen=True)
class XferTelemetry:
    """NIXL's own per-request numbers (microseconds, bytes, descriptors after NIXL's merging)."""

    post_us: int
    xfer_us: int
    total_bytes: int
    descriptors: int


class NixlAgent:
    """One NIXL agent with the configured backends (UCX by default)."""

    def __init__(self, name: str, backends: Sequence[str], *, num_threads: int = 0,
                 progress_delay_us: int = 10_000) -> None:
        """``progress_delay_us``: the progress thread's idle wake-up period; 0 disables the thread (then
        only this agent's own calls progress it, which is not enough to serve peers)."""
        _, _, config_cls = _load()
        self._lock = threading.RLock()
        self.name = name
        config = config_cls(backends=[], capture_telemetry=True, num_threads=num_threads,
                            enable_prog_thread=progress_delay_us > 0)
        try:
            self._agent: Any = _make_agent(name, config, progress_delay_us)
        except Exception as exc:
            raise NixlUnavailableError(f"cannot create a NIXL agent: {type(exc).__name__}: {exc}") from exc
        available = list(self._agent.get_plugin_list())
        for backend in backends:
            init = {"num_threads": str(num_threads)} if num_threads > 0 else {}
            try:
                self._agent.create_backend(backend, init)
            except Exception as exc:
                raise NixlUnavailableError(
                    f"NIXL backend {backend!r} could not be created ({type(exc).__name__}: {exc}); plugins "
                    f"found: {available}. LIBFABRIC needs libfabric >= 1.10 and an EFA/verbs device; use "
                    "backends=('UCX',) on machines without one"
                ) from exc
        if not backends:
            raise NixlUnavailableError("no NIXL backend configured; pass backends=('UCX',)")
        self.backends = tuple(backends)
        self._live = {"registration": 0, "dlist": 0, "xfer": 0}
        self._stuck: list[NixlXfer] = []
        self._xfers_to: Counter[str] = Counter()  # remote agent -> requests to it not released yet
        self._removing: set[str] = set()  # remote agents to remove once their last request is released

    # -- bookkeeping ---------------------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Live registrations, prepared lists and transfer handles (stuck ones included), and remote agents
        whose removal waits for their requests."""
        with self._lock:
            return {**self._live, "stuck_xfer": len(self._stuck), "removals_pending": len(self._removing)}

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                raise NixlCallError(what, exc) from exc

    # -- memory --------------------------------------------------------------------------------------------
    def register(self, regions: Sequence[tuple[int, int]], mem_type: MemType, device_id: int) -> NixlRegistration:
        descs = [(int(addr), int(size), int(device_id), "") for addr, size in regions]
        raw = self._call("register_memory", self._agent.register_memory, descs, mem_type)
        with self._lock:
            self._live["registration"] += 1
        return NixlRegistration(raw)

    def deregister(self, handle: NixlRegistration) -> None:
        if handle.released:
            return
        self._call("deregister_memory", self._agent.deregister_memory, handle.raw)
        with self._lock:
            handle.released = True
            self._live["registration"] -= 1

    # -- peers and metadata --------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        return bytes(self._call("get_agent_metadata", self._agent.get_agent_metadata))

    def add_remote(self, metadata: bytes) -> str:
        name = self._call("add_remote_agent", self._agent.add_remote_agent, metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def connect(self, name: str) -> None:
        """Set up the backend connection now rather than on the first transfer."""
        self._call("make_connection", self._agent.make_connection, name)

    def remove_remote(self, name: str) -> bool:
        """Unload a remote agent, or (False) remember to once no request to it is left unreleased."""
        with self._lock:
            if self._xfers_to[name] > 0:
                self._removing.add(name)
                return False
            self._removing.discard(name)
            self._call("remove_remote_agent", self._agent.remove_remote_agent, name)
            return True

    def removal_pending(self, name: str) -> bool:
        """True while remote agent ``name`` waits for its in-flight requests before it is removed."""
        with self._lock:
            return name in self._removing

    # -- descriptor lists ----------------------------------------------------------------------------------
    def prep_dlist(self, remote: str | None, descs: Descriptors, mem_type: MemType) -> NixlDescList:
        """Prepare a list once; ``remote=None`` for the local side."""
        raw = self._call("prep_xfer_dlist", self._agent.prep_xfer_dlist, remote or "NIXL_INIT_AGENT",
                         np.ascontiguousarray(descs, dtype=np.uint64), mem_type)
        with self._lock:
            self._live["dlist"] += 1
        return NixlDescList(raw, remote=remote)

    def release_dlist(self, handle: NixlDescList) -> None:
        if handle.released:
            return
        self._call("release_dlist_handle", self._agent.release_dlist_handle, handle.raw)
        with self._lock:
            handle.released = True
            self._live["dlist"] -= 1

    # -- transfers -----------------------------------------------------------------------------------------
    def make_xfer(self, local: Descriptors, local_mem: MemType, remote: Descriptors, remote_mem: MemType,
                  remote_agent: str, notif: bytes = b"") -> NixlXfer:
        """One READ request from explicit (addr, len, dev) rows (``initialize_xfer``: no NIXL merging)."""
        with self._lock:
            ldescs = self._call("get_xfer_descs", self._agent.get_xfer_descs,
                                np.ascontiguousarray(local, dtype=np.uint64), local_mem)
            rdescs = self._call("get_xfer_descs", self._agent.get_xfer_descs,
                                np.ascontiguousarray(remote, dtype=np.uint64), remote_mem)
            raw = self._call("initialize_xfer", self._agent.initialize_xfer, "READ", ldescs, rdescs,
                             remote_agent, notif)
            return self._count_xfer(NixlXfer(raw, remote=remote_agent))

    def make_prepped_xfer(self, local: NixlDescList, local_idx: npt.NDArray[np.int32], remote: NixlDescList,
                          remote_idx: npt.NDArray[np.int32], notif: bytes = b"") -> NixlXfer:
        """One READ request by index into prepared lists (NIXL merges runs contiguous on both sides)."""
        with self._lock:
            raw = self._call("make_prepped_xfer", self._agent.make_prepped_xfer, "READ", local.raw,
                             np.ascontiguousarray(local_idx, dtype=np.int32), remote.raw,
                             np.ascontiguousarray(remote_idx, dtype=np.int32), notif)
            return self._count_xfer(NixlXfer(raw, remote=remote.remote or ""))

    def _count_xfer(self, xfer: NixlXfer) -> NixlXfer:
        self._live["xfer"] += 1
        self._xfers_to[xfer.remote] += 1
        return xfer

    def post(self, handle: NixlXfer) -> XferState:
        state: XferState = self._call("transfer", self._agent.transfer, handle.raw)
        return state

    def state(self, handle: NixlXfer) -> XferState:
        state: XferState = self._call("check_xfer_state", self._agent.check_xfer_state, handle.raw)
        return state

    def telemetry(self, handle: NixlXfer) -> XferTelemetry | None:
        try:
            t = self._call("get_xfer_telemetry", self._agent.get_xfer_telemetry, handle.raw)
        except NixlCallError:
            return None
        return XferTelemetry(int(t.postDuration), int(t.xferDuration), int(t.totalBytes), int(t.descCount))

    def release(self, handle: NixlXfer) -> bool:
        """Release (NIXL cancels it if still active; a READ already asked of the peer may land anyway: retire
        requests through the quarantine instead). False when NIXL refused: the handle is retried later."""
        with self._lock:
            if handle.released:
                return True
            try:
                self._agent.release_xfer_handle(handle.raw)
            except Exception:
                if handle not in self._stuck:
                    self._stuck.append(handle)
                return False
            handle.released = True
            self._live["xfer"] -= 1
            if handle in self._stuck:
                self._stuck.remove(handle)
            self._xfers_to[handle.remote] -= 1
            if self._xfers_to[handle.remote] <= 0:
                del self._xfers_to[handle.remote]
                if handle.remote in self._removing:
                    self._removing.discard(handle.remote)
                    try:
                        self._agent.remove_remote_agent(handle.remote)
                    except Exception as exc:
                        log.debug("kvshuttle: removing %s: %s", handle.remote, exc)
            return True

    def retry_stuck(self) -> int:
        """Try again to release handles NIXL could not cancel; returns how many are still stuck."""
        with self._lock:
            for handle in list(self._stuck):
                self.release(handle)
            return len(self._stuck)

    # -- notifications -------------------------------------------------------------------------------------
    def notifs(self) -> dict[str, list[bytes]]:
        got = self._call("get_new_notifs", self._agent.get_new_notifs)
        return {(k.decode() if isinstance(k, bytes) else str(k)): [bytes(m) for m in v] for k, v in got.items()}

    def send_notif(self, remote_agent: str, message: bytes) -> None:
        self._call("send_notif", self._agent.send_notif, remote_agent, message)
