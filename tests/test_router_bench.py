"""``kvshuttle bench router --quick``: the load bench runs end to end (fake backends, router processes, redis
when installed), prints the common JSON shape, and loses or crosses no handle. Speed is the bench's business,
not this test's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from kvshuttle.bench.schema import check

pytest.importorskip("aiohttp")


def test_the_router_bench_runs_and_keeps_every_handle() -> None:
    # its own process group: a timeout kills the bench's children (fake servers, routers, redis) with it
    proc = subprocess.Popen([sys.executable, "-m", "kvshuttle.cli", "bench", "router", "--quick", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=280)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == 0, err[-2000:]
    result = json.loads(out)
    check(result)
    done = [r for r in result["results"] if "skipped" not in r]
    assert result["command"] == "kvshuttle bench router --quick --json"
    assert done and done[0]["store"] == "memory"
    assert result["summary"]["lost_handles"] == 0 and result["summary"]["cross_tenant_handles"] == 0
    for case in done:
        assert case["errors"] == {}
        assert case["handles"]["later_turns"] > 0
        assert case["handles"]["hits_at_prefill"] == case["handles"]["later_turns"] == case["handles"]["router_hits"]
        assert case["latency"]["total_p99_ms"]["router"] is not None
