"""kvshuttle inside vLLM: ``KVShuttleConnector``, one connector for both directions.

Load it with ``kv_connector="KVShuttleConnector"`` and ``kv_connector_module_path="kvshuttle.integrations.vllm"``
(see the README). The connector class imports vLLM on first access; :mod:`.config` does not need it.
"""

from __future__ import annotations

from typing import Any

from .config import ConnectorConfigError, ShuttleConfig

__all__ = ["ConnectorConfigError", "KVShuttleConnector", "ShuttleConfig"]


def __getattr__(name: str) -> Any:  # vLLM does getattr(import_module(path), "KVShuttleConnector")
    if name == "KVShuttleConnector":
        from .connector import KVShuttleConnector

        return KVShuttleConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
