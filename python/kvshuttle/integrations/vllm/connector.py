"""``KVShuttleConnector``: the facade vLLM loads (``kv_connector="KVShuttleConnector"``,
``kv_connector_module_path="kvshuttle.integrations.vllm"``). It only routes each hook to the scheduler side
(:mod:`.scheduler`) or the worker side (:mod:`.worker`); every decision is kvshuttle's."""

from __future__ import annotations

from typing import Any

from .compat import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    attention_backend,
    check_version,
    force_recompute_on_load_failure,
    model_name,
)
from .config import ConnectorConfigError, ShuttleConfig
from .metadata import ShuttleHandshake, ShuttleMetadata
from .scheduler import ShuttleScheduler
from .stats import ShuttlePromMetrics, ShuttleStats
from .worker import ShuttleWorker


class KVShuttleConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_version()
        transfer = vllm_config.kv_transfer_config
        config = ShuttleConfig.from_extra(dict(transfer.kv_connector_extra_config or {}),
                                          model=model_name(vllm_config))
        if vllm_config.parallel_config.world_size > 1:
            raise ConnectorConfigError("kvshuttle's vLLM connector supports one worker per engine (TP=PP=1) so far")
        engine_id = str(transfer.engine_id)
        block_size = int(vllm_config.cache_config.block_size)
        self._scheduler: ShuttleScheduler | None = None
        self._worker: ShuttleWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            force_recompute_on_load_failure(vllm_config)
            self._scheduler = ShuttleScheduler(config, engine_id, block_size)
        else:
            self._worker = ShuttleWorker(config, engine_id, block_size)

    # -- scheduler side -------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta()

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output.finished_sending,
                                                getattr(connector_output, "invalid_block_ids", None))

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self._scheduler is not None
        first = metadata.get(0)
        if isinstance(first, ShuttleHandshake):
            self._scheduler.address = first

    # -- worker side ----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches, attention_backend(self._vllm_config))

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.handshake() if self._worker is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, ShuttleMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        sending, recving = self._worker.finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- observability (both sides) -------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> ShuttleStats | None:
        stats = self._scheduler.take_stats() if self._scheduler is not None else None
        if self._worker is not None:
            stats = self._worker.take_stats()
        return None if stats is None or stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ShuttleStats:
        return ShuttleStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> ShuttlePromMetrics:
        return ShuttlePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
