"""The one JSON shape every ``kvshuttle bench <x> --json`` prints, built by :func:`envelope`.

Top level (the same keys, in this order, for every bench; :data:`TOP_LEVEL_KEYS`):

* ``bench``: ``pack`` | ``plan`` | ``transfer`` | ``policy`` | ``retention``;
* ``schema``: :data:`SCHEMA_VERSION`; ``version``: kvshuttle's; ``commit``: ``git describe --always --dirty`` of
  the source tree when it is a checkout, else ``None``;
* ``command``: the command line that reproduces this output (``kvshuttle bench <x> [options] --json``, options
  that differ from their defaults only);
* ``machine``: ``cpus`` (``os.cpu_count()``), ``usable_cpus`` (this process's affinity), ``native_threads``
  (the native thread pool, ``None`` without the extension), ``gpu`` (device name, ``None`` when not used),
  ``python``, ``arch``, ``load_avg`` (1/5/15-minute load averages at the end of the run, this run's own threads
  included: on a shared machine, how busy it was);
* ``config``: every option of the run, as parsed (after ``--quick`` and similar presets);
* ``note``: one line on what was scaled down and how times were taken;
* ``results``: one dict per case (below); ``summary``: numbers across cases (``{}`` when none);
* ``seconds``: the wall time of the whole run.

Inside a result the same things have the same names:

* ``bytes``: payload bytes one call moves; ``pieces`` / ``bytes_per_piece``: (block, layer, K/V) pieces;
* ``descriptors`` / ``bytes_per_descriptor``: NIXL descriptor rows per method (dicts keyed by method);
* ``rounds``: timed rounds; ``seconds``: median seconds per call (per operation) of each method, a dict;
  ``gbps``: ``bytes`` / ``seconds`` in 1e9 bytes per second, where bytes move;
  ``kernel_seconds`` / ``kernel_gbps``: the same from CUDA events (GPU runs only);
* ``<subject>_vs_<peer>``: how many times faster ``subject`` is than ``peer`` (peer time / subject time; > 1:
  subject faster), the median over rounds of the ratio measured within each round when the methods were
  interleaved round by round; ``ratio_spread[<subject>_vs_<peer>]``: ``min``, ``q1``, ``median``, ``q3``,
  ``max`` of those per-round ratios;
* ``verified``: whether the bytes (or the decision) each method produced were checked, per method or overall.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
TOP_LEVEL_KEYS = ("bench", "schema", "version", "commit", "command", "machine", "config", "note", "results",
                  "summary", "seconds")
MACHINE_KEYS = ("cpus", "usable_cpus", "native_threads", "gpu", "python", "arch", "load_avg")
# Written since issue 19 (files made before lack them): tell a faster machine from a faster kvshuttle.
MACHINE_DETAIL_KEYS = ("cpu_model", "llc_bytes")
_NOT_CONFIG = ("command", "bench", "module", "json")


def machine(gpu: str | None = None) -> dict[str, Any]:
    """The machine the numbers come from (``gpu``: the device name when the run used one)."""
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    try:
        from .. import _native

        threads: int | None = int(_native.num_threads())
    except ImportError:  # pragma: no cover - built without the extension
        threads = None
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not available
        load = None
    return {"cpus": os.cpu_count(), "usable_cpus": usable, "native_threads": threads, "gpu": gpu,
            "python": platform.python_version(), "arch": platform.machine(), "load_avg": load,
            "cpu_model": _cpu_model(), "llc_bytes": _llc_bytes()}


def _cpu_model() -> str | None:
    """The CPU's model name (Linux /proc/cpuinfo), or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def _llc_bytes() -> int | None:
    """The size of the last-level cache cpu0 sees (Linux sysfs), or None."""
    levels = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"))
    best: tuple[int, int] | None = None
    for index in levels:
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        nbytes = int(size[:-1]) * units[size[-1]] if size[-1:] in units else int(size)
        if best is None or level > best[0]:
            best = (level, nbytes)
    return None if best is None else best[1]


def command_line(bench: str, args: argparse.Namespace,
                 add_arguments: Callable[[argparse.ArgumentParser], None]) -> str:
    """``kvshuttle bench <bench> ... --json`` with the options of ``args`` that differ from their defaults."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    parts = ["kvshuttle", "bench", bench]
    for key, default in defaults.items():
        value = getattr(args, key, default)
        if value == default:
            continue
        option = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                parts.append(option)
        else:
            parts += [option, str(value)]
    return " ".join([*parts, "--json"])


def config(args: argparse.Namespace) -> dict[str, Any]:
    """Every option of the run (the CLI's own bookkeeping left out)."""
    return {k: v for k, v in vars(args).items()
            if k not in _NOT_CONFIG and isinstance(v, (bool, int, float, str, type(None)))}


def source_commit() -> str | None:
    """``git describe --always --dirty`` of the tree this package runs from, or None (not a checkout)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def envelope(bench: str, args: argparse.Namespace, add_arguments: Callable[[argparse.ArgumentParser], None],
             results: list[dict[str, Any]], *, note: str, started: float, gpu: str | None = None,
             summary: Mapping[str, Any] | None = None, command_args: argparse.Namespace | None = None,
             ) -> dict[str, Any]:
    """The JSON object a bench prints: :data:`TOP_LEVEL_KEYS` in order (``started``: ``time.perf_counter()``
    when the run began; ``command_args``: the options as given, when ``args`` holds a preset's values)."""
    from .. import __version__

    return {
        "bench": bench,
        "schema": SCHEMA_VERSION,
        "version": __version__,
        "commit": source_commit(),
        "command": command_line(bench, command_args or args, add_arguments),
        "machine": machine(gpu),
        "config": config(args),
        "note": note,
        "results": results,
        "summary": dict(summary or {}),
        "seconds": round(time.perf_counter() - started, 1),
    }


def check(result: Mapping[str, Any]) -> None:
    """Raise ValueError unless ``result`` has the schema's top-level and machine keys (a test helper)."""
    if tuple(result) != TOP_LEVEL_KEYS:
        raise ValueError(f"top-level keys {tuple(result)}, expected {TOP_LEVEL_KEYS}")
    if result["schema"] != SCHEMA_VERSION:
        raise ValueError(f"schema {result['schema']}, expected {SCHEMA_VERSION}")
    keys = tuple(result["machine"])
    if keys not in (MACHINE_KEYS, MACHINE_KEYS + MACHINE_DETAIL_KEYS):
        raise ValueError(f"machine keys {keys}, expected {MACHINE_KEYS} (+ {MACHINE_DETAIL_KEYS} since issue 19)")
    if not isinstance(result["results"], list) or not all(isinstance(r, Mapping) for r in result["results"]):
        raise ValueError("results must be a list of dicts")
