"""The router tests' fixtures (loaded with ``pytest_plugins = ["router_fixtures"]``): an event loop in a thread
and a real ``redis-server`` on a free port, killed afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from router_helpers import LoopThread, RedisServer


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    try:
        yield thread
    finally:
        thread.close()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()
