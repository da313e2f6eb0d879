"""The auto path's per-peer model (transfer/path_model.py): deterministic choices from recorded reads."""

from __future__ import annotations

import pytest

from kvshuttle.transfer.path_model import PathModel, bucket_of

MIB = 1 << 20
READ = 64 * MIB  # bytes of the reads below
KIB4, KIB32 = 4096.0, 32768.0


def feed(model: PathModel, path: str, gbps: float, per_descriptor: float = KIB4, total: int = READ,
         times: int = 1) -> None:
    for _ in range(times):
        model.record(path, per_descriptor, total, total / (gbps * 1e9))


def test_prior_is_the_threshold_until_anything_is_measured() -> None:
    model = PathModel(threshold_bytes=32 << 10)
    small, big = model.choose(KIB4, READ), model.choose(KIB32, READ)
    assert (small.path, big.path) == ("packed", "direct")
    assert "not measured yet" in small.reason and "< threshold" in small.reason
    assert ">= threshold" in big.reason
    assert small.direct_gbps is None and small.packed_gbps is None


def test_the_unmeasured_path_is_explored_once() -> None:
    model = PathModel(threshold_bytes=32 << 10)
    feed(model, "packed", 2.0)
    choice = model.choose(KIB4, READ)
    assert choice.path == "direct" and "exploring" in choice.reason and "packed 2.00 GB/s" in choice.reason


@pytest.mark.parametrize(("direct", "packed", "want"), [(2.5, 1.9, "direct"), (1.0, 3.0, "packed")])
def test_the_faster_measured_path_wins_whatever_the_prior(direct: float, packed: float, want: str) -> None:
    """4 KiB pieces whose prior says packed read direct when direct measured faster (and vice versa)."""
    model = PathModel(threshold_bytes=32 << 10, explore_every=0)
    feed(model, "direct", direct)
    feed(model, "packed", packed)
    choices = [model.choose(KIB4, READ) for _ in range(50)]
    assert {c.path for c in choices} == {want}
    assert "measured faster" in choices[0].reason
    assert choices[0].direct_gbps == pytest.approx(direct) and choices[0].packed_gbps == pytest.approx(packed)


def test_every_nth_decision_explores_the_slower_path() -> None:
    model = PathModel(threshold_bytes=32 << 10, explore_every=4)
    feed(model, "direct", 3.0)
    feed(model, "packed", 1.0)
    paths = [model.choose(KIB4, READ).path for _ in range(12)]
    assert paths == ["direct", "direct", "direct", "packed"] * 3


def test_the_estimate_follows_new_reads() -> None:
    """The median moves to a changed machine: a path that became slower loses after a few reads."""
    model = PathModel(threshold_bytes=32 << 10, explore_every=0)
    feed(model, "direct", 3.0)
    feed(model, "packed", 2.0)
    assert model.choose(KIB4, READ).path == "direct"
    feed(model, "direct", 1.0, times=3)
    estimate = model.estimate("direct", KIB4, READ)
    assert estimate is not None and estimate < 2.0e9
    assert model.choose(KIB4, READ).path == "packed"


def test_one_outlier_does_not_flip_a_settled_choice() -> None:
    model = PathModel(threshold_bytes=32 << 10, explore_every=0)
    feed(model, "direct", 3.0, times=5)
    feed(model, "packed", 2.0, times=5)
    feed(model, "direct", 1.0)  # one slow read (a busy spell)
    assert model.choose(KIB4, READ).path == "direct"


def test_slow_spells_do_not_flip_a_settled_choice_but_a_changed_machine_does() -> None:
    """Three slow reads in a row of the faster path (a shared VM's busy spell) leave it faster; a fourth of
    the last seven, and the machine has changed: the other path wins."""
    model = PathModel(threshold_bytes=32 << 10, explore_every=0)
    feed(model, "direct", 3.0, times=7)
    feed(model, "packed", 2.0, times=7)
    feed(model, "direct", 1.0, times=3)
    assert model.choose(KIB4, READ).path == "direct"
    assert model.estimate("direct", KIB4, READ) == pytest.approx(3.0e9)
    feed(model, "direct", 1.0)
    assert model.choose(KIB4, READ).path == "packed"


def test_buckets_keep_piece_sizes_and_read_sizes_apart() -> None:
    model = PathModel(threshold_bytes=32 << 10, explore_every=0)
    feed(model, "direct", 3.0, per_descriptor=KIB32)
    feed(model, "packed", 1.0, per_descriptor=KIB32)
    feed(model, "direct", 1.0)
    feed(model, "packed", 3.0)
    assert model.choose(KIB32, READ).path == "direct"
    assert model.choose(KIB4, READ).path == "packed"
    assert model.choose(KIB4, 4 * READ).path == "packed"  # an unmeasured read size: back to the prior
    assert "not measured yet" in model.choose(KIB4, 4 * READ).reason
    assert bucket_of(KIB4, READ) == (12, 26) and bucket_of(KIB4 + 100, READ + 1) == (12, 26)
    assert bucket_of(0.5, 1) == (0, 0)


def test_unknown_untimed_and_empty_reads_are_not_recorded() -> None:
    model = PathModel(threshold_bytes=32 << 10)
    model.record("direct", KIB4, READ, 0.0)
    model.record("layered", KIB4, READ, 1e-3)
    model.record("direct", KIB4, 0, 1e-3)
    assert model.estimate("direct", KIB4, READ) is None and model.estimate("direct", KIB4, 0) is None
    assert model.choose(KIB4, READ).path == "packed"


def test_small_reads_are_decided_by_their_own_measurements() -> None:
    """A 256 KiB read of 4 KiB pieces: the prior says packed, but its fixed costs make it slower than direct."""
    model = PathModel(threshold_bytes=32 << 10, explore_every=0)
    small = 256 << 10
    assert model.choose(KIB4, small).path == "packed"
    model.record("packed", KIB4, small, 2.5e-3)
    assert model.choose(KIB4, small).path == "direct"  # exploring the other path
    model.record("direct", KIB4, small, 0.8e-3)
    choice = model.choose(KIB4, small)
    assert choice.path == "direct" and "measured faster" in choice.reason
    assert model.choose(KIB4, READ).path == "packed"  # a large read of the same pieces keeps its own bucket
