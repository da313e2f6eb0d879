"""``KVShuttleConnector``: the facade vLLM loads (``kv_connector="KVShuttleConnector"``,
``kv_connector_module_path="kvshuttle.integrations.vllm"``). It only routes each hook to the scheduler side
(:mod:`.scheduler`) or the worker side (:mod:`.worker`); every decision is kvshuttle's.

No hook can take vLLM down: an exception escaping a hook would kill the EngineCore and every request on it, so
each per-step hook catches any ``Exception``, has :class:`.guard.HookGuard` log it (once per kind, with the
request id) and count it (``hook_error.<hook>`` in the connector stats), and returns the safe answer:
recompute (``(0, False)``), not retained (``(False, None)``), empty metadata, no stats. Where vLLM already
waits on this side (an asynchronous load it was promised), the safe answer still reports that load, failed,
so vLLM recomputes instead of waiting forever. Only start-up (configuration, cache registration) raises:
a misconfigured engine must not start.
"""

from __future__ import annotations

import logging
from typing import Any

from .compat import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    attention_backend,
    cache_dtype,
    check_version,
    engine_prefix_cache,
    force_recompute_on_load_failure,
    model_name,
    on_cpu,
    parallel_layout,
    worker_tp_rank,
)
from .config import ConnectorConfigError, ShuttleConfig
from .content_lookups import content_lookups
from .guard import HookGuard
from .metadata import ShuttleHandshake, ShuttleMetadata
from .scheduler import ShuttleScheduler
from .stats import ShuttlePromMetrics, ShuttleStats
from .worker import ShuttleWorker

log = logging.getLogger("vllm.kvshuttle")


class KVShuttleConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_version()
        transfer = vllm_config.kv_transfer_config
        config = ShuttleConfig.from_extra(dict(transfer.kv_connector_extra_config or {}),
                                          model=model_name(vllm_config))
        try:
            parallel = parallel_layout(vllm_config)
        except ValueError as exc:
            raise ConnectorConfigError(str(exc)) from None
        engine_id = str(transfer.engine_id)
        block_size = int(vllm_config.cache_config.block_size)
        if role == KVConnectorRole.SCHEDULER:
            force_recompute_on_load_failure(vllm_config)
            scheduler = ShuttleScheduler(config, engine_id, block_size, tp_size=parallel.tp_size,
                                         num_layers=parallel.num_layers, cpu_host=on_cpu(),
                                         cache_dtype=cache_dtype(vllm_config))
            if config.content_index is not None:
                scheduler.lookups = content_lookups(config.content_index, scheduler.secret, block_size,
                                                    config.content_index_wait_s)
            self._attach(scheduler, None)
        else:  # one worker per tensor-parallel rank, each serving and reading its own head shard
            rank = worker_tp_rank() if parallel.tp_size > 1 else 0
            self._attach(None, ShuttleWorker(config, engine_id, block_size, tp_rank=rank, tp_size=parallel.tp_size,
                                             num_kv_heads=parallel.num_kv_heads))

    def _attach(self, scheduler: ShuttleScheduler | None, worker: ShuttleWorker | None) -> None:
        """Bind this facade to its side (tests build the facade around a side without vLLM this way)."""
        self._scheduler = scheduler
        self._worker = worker
        self._guard = HookGuard()

    # -- scheduler side -------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        try:
            if not self._scheduler.prefix_cache_bound:  # vLLM's scheduler is the caller: find its prefix cache once
                self._scheduler.bind_prefix_cache(engine_prefix_cache(self))
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as exc:
            self._guard.failed("get_num_new_matched_tokens", exc, request)
            self._forget(request)
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        try:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception as exc:
            self._guard.failed("update_state_after_alloc", exc, request)
            if isinstance(num_external_tokens, int) and num_external_tokens > 0:
                try:  # vLLM now waits for this load: it must be reported, failed, or the request hangs
                    self._scheduler.fail_load(request, blocks, num_external_tokens, f"{exc!r} while scheduling it")
                except Exception as again:
                    self._guard.failed("fail_load", again, request)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        try:
            return self._scheduler.build_connector_meta()
        except Exception as exc:
            self._guard.failed("build_connector_meta", exc)
            return ShuttleMetadata()

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        try:
            return self._scheduler.request_finished(request, block_ids)
        except Exception as exc:  # the scheduler commits a retention last: nothing was kept
            self._guard.failed("request_finished", exc, request)
            self._forget(request)
            return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        try:
            worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
            sending, recving = self._scheduler.update_connector_output(
                connector_output.finished_sending, getattr(connector_output, "invalid_block_ids", None),
                getattr(connector_output, "finished_recving", None), getattr(worker_meta, "ended", None),
                getattr(worker_meta, "landed", None))
            # vLLM frees and admits from these right after this hook: only ids this side vouches for
            connector_output.finished_sending = sending or None
            connector_output.finished_recving = recving or None
        except Exception as exc:
            self._guard.failed("update_connector_output", exc)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self._scheduler is not None
        try:  # {tp_rank: handshake}: every rank's side channel goes into the handles
            self._scheduler.set_ranks({rank: m for rank, m in metadata.items() if isinstance(m, ShuttleHandshake)})
        except Exception as exc:  # without the addresses nothing is retained (counted there)
            self._guard.failed("set_xfer_handshake_metadata", exc)

    def _forget(self, request: Any) -> None:
        assert self._scheduler is not None
        try:
            self._scheduler.forget(request)
        except Exception as exc:
            self._guard.failed("forget", exc, request)

    # -- worker side ----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches, attention_backend(self._vllm_config))

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.handshake() if self._worker is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        try:
            meta = self._get_connector_metadata()
            assert isinstance(meta, ShuttleMetadata)
            self._worker.start(meta)
        except Exception as exc:
            self._guard.failed("start_load_kv", exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """vLLM's attention wrapper, on entry to each layer: a layer-pipelined load's layer must have landed."""
        if self._worker is None:
            return
        try:
            self._worker.wait_for_layer(layer_name)
        except Exception as exc:  # nothing credited: the step's layered loads are reported invalid
            self._guard.failed("wait_for_layer_load", exc)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        """After the forward pass: settle this step's layer-pipelined loads (failures become invalid blocks)."""
        if self._worker is None:
            return
        try:
            self._worker.settle_layered()
        except Exception as exc:
            self._guard.failed("wait_for_save", exc)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        try:
            sending, recving = self._worker.finished(finished_req_ids)
        except Exception as exc:  # worker.finished itself does not raise; this is the last line
            self._guard.failed("get_finished", exc)
            return None, None
        return sending or None, recving or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        try:
            return self._worker.worker_meta()
        except Exception as exc:
            self._guard.failed("build_connector_worker_meta", exc)
            return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        try:
            return self._worker.load_errors()
        except Exception as exc:
            self._guard.failed("get_block_ids_with_load_errors", exc)
            return set()

    # -- vLLM 0.33's sleep mode: refused (a released cache must never be served from stale registrations) -----
    @classmethod
    def supports_sleep_mode(cls, *args: Any, **kwargs: Any) -> bool:
        """No: the cache's NIXL registrations and the retained handles would outlive the memory sleep releases, so
        a peer could read discarded KV. vLLM then refuses ``enable_sleep_mode`` with this connector."""
        return False

    def unregister_kv_caches(self, *args: Any, **kwargs: Any) -> None:
        """Called before the KV cache is released (a discard, even without sleep mode): stop serving it."""
        if self._worker is not None:
            try:
                self._worker.release_cache()
            except Exception as exc:
                self._guard.failed("unregister_kv_caches", exc)

    def restore_kv_caches(self, *args: Any, **kwargs: Any) -> None:
        """The cache is back, but kvshuttle does not re-register it: this worker recomputes until it restarts."""
        log.warning("kvshuttle: the KV cache was restored; kvshuttle stays off on this worker until it restarts")

    def shutdown(self) -> None:
        if self._worker is not None:
            try:
                self._worker.shutdown()
            except Exception as exc:
                self._guard.failed("shutdown", exc)
        if self._scheduler is not None and self._scheduler.lookups is not None:
            try:
                self._scheduler.lookups.close()
            except Exception as exc:
                self._guard.failed("shutdown", exc)

    # -- observability (both sides) -------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> ShuttleStats | None:
        try:
            side = self._scheduler if self._scheduler is not None else self._worker
            stats = side.take_stats() if side is not None else ShuttleStats(data={})
        except Exception as exc:
            self._guard.failed("get_kv_connector_stats", exc)
            stats = ShuttleStats(data={})
        stats.data.update(self._guard.take())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ShuttleStats:
        return ShuttleStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> ShuttlePromMetrics:
        return ShuttlePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
