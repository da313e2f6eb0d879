"""The CUDA executor's host-side logic on CPU, against a stand-in for cupy that records what is enqueued.

What the GPU run must still show (tests/test_cuda_pipeline.py) is that the events really complete after the
kernel; what is checked here is the order the executor enqueues things in, on which stream and device, and how a
completion reports time, errors and time-outs.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from kvshuttle.transfer import executors
from kvshuttle.transfer.executors import CudaExecutor, EventCompletion


class FakeCuda:
    """cupy.cuda's Device, Stream, Event and get_elapsed_time, logging every call in order."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.current_device = 0
        fake = self

        class Device:
            def __init__(self, index: int) -> None:
                self.index = index

            def __enter__(self) -> None:
                fake.log.append(("device", self.index))
                fake.current_device = self.index

            def __exit__(self, *exc: object) -> None:
                fake.current_device = 0

        class Stream:
            def __init__(self, non_blocking: bool = False) -> None:
                self.ptr = 0x5000 + len(fake.log)
                self.device = fake.current_device
                fake.log.append(("stream", self.ptr, non_blocking, self.device))

        class Event:
            def __init__(self) -> None:
                self.recorded_on: int | None = None
                self.finished = False
                self.fails = False

            def record(self, stream: Any) -> None:
                self.recorded_on = stream.ptr
                fake.log.append(("record", stream.ptr))

            @property
            def done(self) -> bool:
                if self.fails:
                    raise RuntimeError("cudaErrorIllegalAddress")
                return self.finished

        self.Device, self.Stream, self.Event = Device, Stream, Event

    def get_elapsed_time(self, start: Any, end: Any) -> float:
        return 2.5  # milliseconds


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cuda = FakeCuda()
    module = types.ModuleType("cupy")
    module.cuda = cuda  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", module)
    return cuda


def test_each_copy_is_enqueued_between_two_events_on_the_executors_own_stream(
        fake_cupy: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_pack(*args: Any, stream: int, **kwargs: Any) -> None:
        fake_cupy.log.append(("pack", stream, fake_cupy.current_device, kwargs["num_tokens"]))

    def fake_unpack(*args: Any, stream: int, **kwargs: Any) -> None:
        fake_cupy.log.append(("unpack", stream, fake_cupy.current_device, kwargs["num_tokens"]))

    monkeypatch.setattr(executors.ops, "pack", fake_pack)
    monkeypatch.setattr(executors.ops, "unpack", fake_unpack)
    executor = CudaExecutor("cuda:3")
    ptr = executor.stream.ptr
    assert fake_cupy.log[-1] == ("stream", ptr, True, 3)  # non-blocking, created on the cache's device
    fake_cupy.log.clear()
    first = executor.pack(None, None, None, num_tokens=16, layout=None, head_offset=0)  # type: ignore[arg-type]
    second = executor.unpack(None, None, None, num_tokens=32, layout=None, head_offset=0)  # type: ignore[arg-type]
    assert fake_cupy.log == [("device", 3), ("record", ptr), ("pack", ptr, 3, 16), ("record", ptr),
                             ("device", 3), ("record", ptr), ("unpack", ptr, 3, 32), ("record", ptr)]
    assert isinstance(first, EventCompletion) and isinstance(second, EventCompletion)
    assert not first.done() and not first.wait(0.01)
    first._end.finished = True  # the device reached the end event
    assert first.done() and first.wait(0.01)
    assert first.result() == pytest.approx(2.5e-3)  # seconds between the two events


def test_a_copy_that_cannot_be_enqueued_raises_at_submission(fake_cupy: FakeCuda,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ValueError("bad ids")

    monkeypatch.setattr(executors.ops, "pack", refuse)
    executor = CudaExecutor("cuda:0")
    with pytest.raises(ValueError, match="bad ids"):
        executor.pack(None, None, None, num_tokens=1, layout=None, head_offset=0)  # type: ignore[arg-type]


def test_a_failed_kernel_makes_the_completion_done_and_its_result_raise(fake_cupy: FakeCuda) -> None:
    start, end = fake_cupy.Event(), fake_cupy.Event()
    completion = EventCompletion(start, end, types.SimpleNamespace(cuda=fake_cupy))
    end.fails = True  # a sticky CUDA error surfaces when the event is queried
    assert completion.done() and completion.wait(0.01)
    with pytest.raises(RuntimeError, match="IllegalAddress"):
        completion.result()
