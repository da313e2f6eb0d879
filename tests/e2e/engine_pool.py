"""Engines shared by several e2e cases, and started together.

Starting a vLLM engine (three processes importing vLLM: about a minute of one core) is most of the e2e stage's time
on CI's 2 cores, so cases whose engines would be started with the same settings lease them from one pool for the
whole session (``shared_engines``, a fixture the modules import: not a ``conftest.py``, whose module name would
shadow ``tests/conftest.py`` for the unit tests' ``from conftest import``). A case names its engines in
``@pytest.mark.shared_engines(...)``. A lease launches the engines the next few cases name too, and waits only
for those it needs: the others start while the cases before theirs run (a case's requests mostly keep one core
busy at a time). An engine is closed right after the last case that names it; closing checks that none of
its processes is left behind. An engine only one case uses (set up for that case, or killed by it) is in the pool
for that early start alone.

What a case leaves on a shared engine, and why the next one is not affected, is each user's business (each says
so): cases on the shared decode use conversations of their own seeds (no prefix-cache hit on another case's
blocks); a prefill is handed over only when it retains no blocks (what a case left for a decode that never came
would be freed by its TTL in the middle of the next case); a case reads only the part of an engine's log written
since it leased it (``Lease.log``). A case that kills or freezes a shared engine must be its last user.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

RETAINED_WAIT_S = 30.0
LOOKAHEAD = 3  # cases ahead whose engines a lease launches

#: name -> (model, log directory) -> the engine's ``EngineSpec``. A module adds the engines only its cases use.
SPECS: dict[str, Callable[[str, Path], Any]] = {}


def pd_role(role: str, name: str, prefill_config: dict[str, Any] | None = None,
            decode_config: dict[str, Any] | None = None, *, model: Callable[[], str] | None = None,
            **pair: Any) -> Callable[[str, Path], Any]:
    """A spec factory: exactly what ``pd_pair(model, shuttle_transfer_config(**prefill_config),
    shuttle_transfer_config(**decode_config), ..., **pair)`` gives ``role``, logging to ``<log dir>/<name>-<role>.log``
    (the pair's other engine is never started). ``model``: builds another model than the tiny Llama, returns its
    path."""
    def spec(tiny_llama: str, log_dir: Path) -> Any:
        from kvshuttle.bench.e2e.engines import pd_pair, shuttle_transfer_config

        engines = pd_pair(model() if model is not None else tiny_llama,
                          shuttle_transfer_config(**(prefill_config or {})),
                          shuttle_transfer_config(**(decode_config or {})), log_dir, name=name, **pair)
        return engines[0 if role == "prefill" else 1].spec
    return spec


# kvshuttle's defaults; pd_pair's decode (prefix cache on)
SPECS["decode"] = pd_role("decode", "decode")
# a prefill that lost the conversation: prefix cache off
SPECS["prefill_no_cache"] = pd_role("prefill", "prefill_no_cache")
# the production prefill: prefix cache on
SPECS["prefill_cached"] = pd_role("prefill", "prefill_cached", prefill_prefix_cache=True)


@dataclass
class Lease:
    """A shared engine as one case sees it: the engine, its log, and where in the log the case began."""

    engine: Any
    log_path: Path
    offset: int

    def log(self) -> str:
        """The engine's log since the case leased it."""
        with open(self.log_path, "rb") as f:
            f.seek(self.offset)
            return f.read().decode(errors="replace")


class EnginePool:
    """Shared engines by name: launched (starting) and ready (see the module docstring)."""

    def __init__(self, model: str, log_dir: Path) -> None:
        self.model = model
        self.log_dir = log_dir
        self.engines: dict[str, Any] = {}  # ready
        self.starting: dict[str, Any] = {}  # launched, not waited for yet

    def launch(self, names: Iterable[str]) -> None:
        """Launch those of ``names`` that are neither ready nor starting (no wait)."""
        from kvshuttle.bench.e2e.engines import VllmEngine

        for name in dict.fromkeys(names):
            if name not in self.engines and name not in self.starting:
                self.starting[name] = VllmEngine(SPECS[name](self.model, self.log_dir), start=False).launch()

    def lease(self, names: tuple[str, ...], own: tuple[Any, ...] = (), soon: tuple[str, ...] = ()) -> list[Lease]:
        """Leases of the shared engines ``names`` (a dead one is replaced), ready; the case's ``own`` engines (not
        started yet) start alongside them. The ``soon`` ones (later cases') are launched, not waited for: at once
        as far as cores are left over (an engine starts on about one core: its processes start one after the
        other), the rest once this case's engines are ready (they then start while the case runs)."""
        for name in names:  # one an earlier case's failure killed (a request timeout kills its engine)
            engine = self.engines.get(name)
            if engine is not None and (engine.proc is None or engine.proc.poll() is not None):
                self.close(name)
        try:
            self.launch(names)
            for engine in own:
                engine.launch()
            spare = (os.cpu_count() or 1) - len(self.starting) - len(own)
            self.launch(soon[:max(0, spare)])
            for name in dict.fromkeys(names):
                if name in self.starting:
                    self.engines[name] = self.starting.pop(name).wait_ready()  # closes it on a failure
            for engine in own:
                engine.wait_ready()
        except BaseException:
            for engine in own:
                engine.close()
            raise
        self.launch(soon)
        for name in names:
            if name.startswith("prefill"):
                self._no_retained(name)
        return [Lease(self.engines[n], Path(self.engines[n].spec.log_path),
                      Path(self.engines[n].spec.log_path).stat().st_size) for n in names]

    def _no_retained(self, name: str) -> None:
        """A prefill's blocks retained for a decode are released when the decode reads them, else by their TTL:
        a case must not find some left by another, whose expiry would move its own usage numbers."""
        deadline = time.monotonic() + RETAINED_WAIT_S
        while (retained := self.engines[name].kv_usage()["kvshuttle_retained_blocks"]) and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        if retained:
            pytest.fail(f"shared engine {name}: an earlier case left {retained} retained blocks on it")

    def close(self, name: str) -> None:
        """Close shared engine ``name``; fails when any of its processes outlives the close."""
        from kvshuttle.bench.e2e.engines import group_pids

        engine = self.engines.pop(name, None) or self.starting.pop(name)
        pgid = engine.proc.pid if engine.proc is not None else None
        engine.close()
        if pgid is not None and group_pids(pgid):
            raise AssertionError(f"shared engine {name}: processes left behind: {group_pids(pgid)}")


_POOL: EnginePool | None = None  # one per session: test modules import the fixture, each its own copy of it


def _names(item: pytest.Item) -> tuple[str, ...]:
    marker = item.get_closest_marker("shared_engines")
    return tuple(marker.args) if marker is not None else ()


def _skipped(item: pytest.Item) -> bool:
    """Marked to skip (a ``skipif`` given as a string counts as skipped: it is not evaluated here)."""
    return item.get_closest_marker("skip") is not None or any(
        m.args[0] if m.args else m.kwargs.get("condition", True) for m in item.iter_markers("skipif"))


def _pool(tmp_path_factory: pytest.TempPathFactory) -> EnginePool:
    from test_vllm_nixl_baseline import vllm_skip_reason

    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    global _POOL
    if _POOL is None:
        from kvshuttle.bench.e2e.tiny_model import assets_root, build_tiny_llama

        _POOL = EnginePool(str(build_tiny_llama(assets_root() / "tiny-llama")), tmp_path_factory.mktemp("shared"))
    return _POOL


@pytest.fixture
def shared_engines(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[Callable[..., list[Lease]]]:
    """``shared_engines(own=(...))``: leases of the engines the case's ``shared_engines`` marker names, in its
    order, its ``own`` engines (not started yet) started alongside (the case closes those). After the case, each
    engine no later case of the session names is closed (they hold 1-2 GiB each)."""
    names = _names(request.node)
    assert names, "a case using shared_engines names them: @pytest.mark.shared_engines('decode', ...)"
    unknown = [n for n in names if n not in SPECS]
    assert not unknown, f"no shared engine {unknown} (engine_pool.SPECS)"
    items = request.session.items
    later_items = items[items.index(request.node) + 1:] if request.node in items else []
    later = {n for other in later_items for n in _names(other)}
    # started early: the engines of the next few cases only (each engine holds 1-2 GiB while it waits)
    soon = tuple(dict.fromkeys(n for other in later_items[:LOOKAHEAD] if not _skipped(other)
                               for n in _names(other) if n in SPECS))
    pool = _pool(tmp_path_factory)
    leases: list[Lease] = []

    def lease(own: tuple[Any, ...] = ()) -> list[Lease]:
        leases.extend(pool.lease(names, own, soon))
        return leases[-len(names):]
    yield lease
    for leased in leases:  # shown with a failed case's output: what its shared engines logged meanwhile
        print(f"{leased.log_path.name} during this case:\n" + "\n".join(leased.log().splitlines()[-40:]))
    for name in [n for n in names if n in pool.engines and n not in later]:
        pool.close(name)
