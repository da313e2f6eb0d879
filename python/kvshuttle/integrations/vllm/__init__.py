"""kvshuttle inside vLLM: ``KVShuttleConnector``, one connector for both directions.

Load it with ``kv_connector="KVShuttleConnector"`` and ``kv_connector_module_path="kvshuttle.integrations.vllm"``
(see the README). Importing this package imports vLLM; the rest of kvshuttle does not.
"""

from __future__ import annotations

from .config import ConnectorConfigError, ShuttleConfig
from .connector import KVShuttleConnector

__all__ = ["ConnectorConfigError", "KVShuttleConnector", "ShuttleConfig"]
