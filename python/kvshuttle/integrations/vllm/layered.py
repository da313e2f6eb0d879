"""Layer-pipelined loads on the worker side (``kvshuttle_load_mode``: ``layered``, or ``auto`` where it pays).

vLLM computes such a request in the very step that loads it (a synchronous load: its read tokens count as
computed). ``start_load_kv`` starts every load of the step before the forward pass (claim, then one NIXL read
per layer); ``wait_for_layer_load(layer)``, called by vLLM's attention wrapper on entry to each layer, blocks
until that layer has landed from every owner rank, so layer i computes while the reads of later layers are
still on the wire. After the forward pass (``wait_for_save``, at the latest ``get_finished``) every load is
settled: it must have landed whole, been confirmed by every owner rank, *and* the forward pass must have waited
for every one of its layers and seen it landed. Anything else (a refused claim, a failed, late or unconfirmed
read, a layer the forward pass computed without waiting: an attention backend that never calls
``wait_for_layer_load``) reports the load's blocks invalid in this same step's output. vLLM then discards the
step's result for the request (no token of it is emitted) and recomputes from the first invalid block. vLLM would
also keep those blocks in its prefix cache, as hits for other requests before (or without) that recompute; the
scheduler side keeps them out of it until the load is reported landed (``sync_loads.py``, fed by the ``landed``
set this side reports in ``ShuttleWorkerMeta``).

A layer's wait never outlasts the load's deadline (``kvshuttle_layered_timeout_s`` from the scheduling
decision, within ``kvshuttle_load_timeout_s``), and the step's loads are settled together: however many owners
are slow, refuse or are dead, the step waits at most the latest deadline plus ``SETTLE_GRACE_S``. One exception,
for correctness: a failed load whose READ NIXL could not cancel (an owner that stopped serving in the middle of a
posted read, alive but stalled) holds the step until the read is over (``_quarantined``), since vLLM recomputes
the blocks in the next step and a late write would land in them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from ...reuse import Failure, ReuseResult
from ...transfer import LayerProgress
from .metadata import LoadJob

log = logging.getLogger("vllm.kvshuttle")
SETTLE_GRACE_S = 1.0  # past its deadline a load's thread is cancelling its reads: this long to hear back
QUARANTINE_WARN_S = 5.0  # while a failed load's read may still write, a warning this often
LOAD_THREAD_GRACE_S = 5.0  # past the settle point a failed load's thread has this long to return its read's state


def load_failure(job: LoadJob, failure: Failure, why: str) -> ReuseResult:
    """The result of a load that did not (or must not count to have) happened: its blocks are recomputed."""
    local = job.decision.local_tokens
    return ReuseResult("local" if local > 0 else "recompute", failure.value, f"recompute, because {why}",
                       job.num_tokens, local, 0, tuple(job.local_block_ids), job.decision)


@dataclass
class _Load:
    job: LoadJob
    future: Future[ReuseResult]
    progress: LayerProgress
    deadline: float  # time.monotonic()
    waited: set[int] = field(default_factory=set)  # layers the forward pass waited for and saw landed
    blocked_s: float = 0.0  # how long the forward pass was blocked on this load's layers


class LayeredLoads:
    """The step's layer-pipelined loads. ``add`` and ``settle`` run on the thread that drives the step and
    ``wait_layer`` in its forward pass (the same thread in vLLM); the loads' own threads only touch their
    :class:`~kvshuttle.transfer.LayerProgress`."""

    def __init__(self, layer_index: Mapping[str, int], num_layers: int) -> None:
        self.layer_index = dict(layer_index)
        self.num_layers = num_layers
        self._loads: list[_Load] = []
        self.waited_s = 0.0  # how long forward passes waited for layers (the worker takes it into its stats)
        self.quarantine_wait_s = 0.0  # how long steps waited for failed loads' reads that NIXL could not cancel
        self._unknown: set[str] = set()

    def __len__(self) -> int:
        return len(self._loads)

    def progress(self) -> LayerProgress:
        return LayerProgress(self.num_layers)

    def add(self, job: LoadJob, future: Future[ReuseResult], progress: LayerProgress, deadline: float) -> None:
        self._loads.append(_Load(job, future, progress, deadline))

    def wait_layer(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV has landed for every load of this step, or its load failed or ran
        out of time (never raises; what did not land is reported invalid when the step settles)."""
        if not self._loads:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None:  # not a layer of the registered cache: nothing is credited, the loads will recompute
            if layer_name not in self._unknown and len(self._unknown) < 64:
                self._unknown.add(layer_name)
                log.warning("kvshuttle: wait_for_layer_load(%r) names no registered KV cache layer", layer_name)
            return
        started = time.monotonic()
        for load in self._loads:
            before = time.monotonic()
            if load.progress.wait(layer, load.deadline - before):
                load.waited.add(layer)
            load.blocked_s += time.monotonic() - before
        self.waited_s += time.monotonic() - started

    def settle(self) -> list[tuple[LoadJob, ReuseResult]]:
        """End the step's loads: each one's job and result, a failure for every load that must recompute. However
        many loads are stuck, this waits at most until the latest deadline plus one grace period, together; then,
        for a failed load only, until nothing of its read can still write its blocks (``_quarantined``)."""
        loads, self._loads = self._loads, []
        settle_by = max((load.deadline for load in loads), default=0.0) + SETTLE_GRACE_S
        settled = [(load.job, self._outcome(load, settle_by)) for load in loads]
        threads_by = settle_by + LOAD_THREAD_GRACE_S
        for load, (_, result) in zip(loads, settled, strict=True):
            if result.action != "fetched":
                self._quarantined(load, threads_by)
        return settled

    def _quarantined(self, load: _Load, threads_by: float) -> None:
        """vLLM recomputes a failed synchronous load's blocks in its very next step, so the step does not end
        while a READ of the load that NIXL could not cancel may still land in them. NIXL has no cancel that stops
        a READ already asked of the owner (measured: the release reports success, removing the remote agent
        reports the read failed, and the bytes still land when the owner's data path resumes), so this waits for
        the quarantine (``ReuseResult.settled``): at once for a refused claim, a dead owner or a read never
        posted; for an owner that stopped serving mid-read, until its data path resumes or the transport gives
        up. Correctness over latency: a late write would be wrong KV, in the prefix cache for everyone. (A load
        thread that has not even returned by ``threads_by``, every wait of its fetch being bounded, is a bug: the
        step goes on, logged.)"""
        started = time.monotonic()
        try:
            result = load.future.result(timeout=max(threads_by - started, 0.0))
        except FutureTimeout:
            log.error("kvshuttle: request %s's load thread did not return %.0f s past its deadline; the step goes on",
                      load.job.request_id, LOAD_THREAD_GRACE_S + SETTLE_GRACE_S)
            return
        except BaseException:  # cancelled before it ran (shutdown): nothing was read
            return
        while not result.settled.wait(QUARANTINE_WARN_S):
            log.warning("kvshuttle: the step waits for request %s's read, which NIXL could not cancel, to end before "
                        "vLLM recomputes its blocks (%.0f s)", load.job.request_id, time.monotonic() - started)
        self.quarantine_wait_s += time.monotonic() - started

    def _outcome(self, load: _Load, settle_by: float) -> ReuseResult:
        log.info("kvshuttle: request %s: the forward pass waited %.1f ms for its %d layers' KV", load.job.request_id,
                 load.blocked_s * 1e3, len(load.waited))
        try:
            result = load.future.result(timeout=max(settle_by - time.monotonic(), 0.0))
        except FutureTimeout:
            return load_failure(load.job, Failure.TRANSFER_TIMEOUT, "the layer-pipelined load did not end by its "
                                                                    "deadline")
        except BaseException as exc:  # cancelled at shutdown, or a bug: the blocks were not (all) written
            return load_failure(load.job, Failure.TRANSFER_FAILED, repr(exc))
        missing = sorted(set(range(self.num_layers)) - load.waited)
        if result.action == "fetched" and missing:
            log.warning("kvshuttle: request %s recomputes: the forward pass did not wait for layers %s",
                        load.job.request_id, missing[:8])
            return load_failure(load.job, Failure.TRANSFER_FAILED,
                                f"the forward pass computed layers {missing[:8]} without waiting for their KV "
                                f"(wait_for_layer_load); use kvshuttle_load_mode=async with this attention backend")
        return result
