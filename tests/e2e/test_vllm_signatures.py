"""The connector's hooks against vLLM's ``KVConnectorBase_V1`` of every supported version, statically.

vLLM 0.33 has no CPU build, so CI cannot run it; instead each version's ``base.py`` (the installed vLLM's, or a
wheel's in ``$KVSHUTTLE_VLLM_WHEELS``, read as a zip) and kvshuttle's ``connector.py`` are parsed with ``ast``
and compared: every method the connector overrides takes every call the base's signature allows, with the same
classmethod/staticmethod binding; every abstract method is defined; the hooks kvshuttle relies on exist; and
``compat.SUPPORTED`` and the README name exactly the versions checked. No vLLM import: this runs in any venv.
A version without a source skips, or fails with ``KVSHUTTLE_REQUIRE_VLLM_WHEELS=1`` (CI's vLLM stage).
"""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

import pytest
import vllm_sources as vs

ROOT = Path(__file__).resolve().parents[2]
CONNECTOR = ROOT / "python/kvshuttle/integrations/vllm/connector.py"
COMPAT = ROOT / "python/kvshuttle/integrations/vllm/compat.py"
README = ROOT / "README.md"

VERSIONS = ("0.32", "0.33")  # every minor line compat.SUPPORTED names; each needs a source in CI
# The hooks vLLM calls on a connector that kvshuttle relies on (overridden now, or about to be).
HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
    "update_connector_output", "set_xfer_handshake_metadata", "register_kv_caches", "get_handshake_metadata",
    "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
    "get_block_ids_with_load_errors", "shutdown", "get_kv_connector_stats", "build_kv_connector_stats",
    "build_prom_metrics", "build_connector_worker_meta",
)
METADATA_CLASSES = ("KVConnectorMetadata", "KVConnectorHandshakeMetadata", "KVConnectorWorkerMetadata")


def _ours() -> vs.ClassInfo:
    return vs.classes(CONNECTOR.read_text())["KVShuttleConnector"]


def _source(minor: str) -> vs.Source:
    source = vs.base_source(minor)
    if source is None:
        wheels = os.environ.get(vs.WHEELS_ENV)
        reason = (f"vLLM {minor}: no base class to compare with: the installed vllm (if any) is not {minor}.x and "
                  f"${vs.WHEELS_ENV} ({wheels or 'unset'}) holds no vllm-{minor}.*.whl "
                  f"(pip download --no-deps vllm=={minor}.0 -d DIR)")
        if vs.require_sources():
            pytest.fail(f"{reason}; required by {vs.REQUIRE_ENV}=1")
        pytest.skip(f"{reason}; {vs.REQUIRE_ENV}=1 fails instead")
    return source


@pytest.mark.parametrize("minor", VERSIONS)
def test_connector_fits_the_base_class(minor: str) -> None:
    source = _source(minor)
    print(f"vLLM {minor}: {source.origin}")
    found = vs.classes(source.text)
    base = found.get("KVConnectorBase_V1")
    assert base is not None, f"vLLM {source.version} ({source.origin}): no class KVConnectorBase_V1"
    problems = vs.compare(source.version, base, _ours(), HOOKS)
    problems += [f"vLLM {source.version}: no class {name} in base.py" for name in METADATA_CLASSES
                 if name not in found]
    assert not problems, f"against {source.origin}:\n" + "\n".join(problems)


def test_every_public_method_is_a_hook_of_some_version() -> None:
    """A public method no supported base defines is never called by vLLM (a misspelt or removed hook)."""
    sources = [_source(minor) for minor in VERSIONS]
    bases = [vs.classes(s.text)["KVConnectorBase_V1"] for s in sources]
    stray = [name for name in _ours().methods
             if not name.startswith("_") and not any(name in b.methods for b in bases)]
    assert not stray, f"KVShuttleConnector methods no vLLM {', '.join(VERSIONS)} base defines: {stray}"


def test_supported_range_is_the_versions_checked() -> None:
    supported = vs.assigned_literal(COMPAT.read_text(), "SUPPORTED")
    assert isinstance(supported, tuple) and len(supported) == 2, supported
    (major, first), (last_major, last) = supported
    assert major == last_major, f"compat.SUPPORTED spans majors: {supported}"
    minors = tuple(f"{major}.{m}" for m in range(first, last + 1))
    assert minors == VERSIONS, (f"compat.SUPPORTED covers vLLM {minors}, this test checks {VERSIONS}: add a base "
                                "class source for each supported version (CI downloads the wheels)")
    sentence = re.search(r"Supported: vLLM (.*?)\.(?:\s|$)", README.read_text(), re.DOTALL)
    assert sentence, "README.md states no 'Supported: vLLM ...' versions"
    named = set(re.findall(r"(?<![\d.])(\d+\.\d+)(?![\d.])", sentence.group(1)))
    assert named == set(VERSIONS), f"README.md's 'Supported: vLLM ...' names {sorted(named)}, compat {minors}"


# ---------------------------------------------------------------------------------------- the checker itself
BASE = '''
import abc
from abc import ABC, abstractmethod

class Base(ABC):
    def __init__(self, vllm_config, role, kv_cache_config): ...
    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs): ...
    @abc.abstractmethod
    def wait_for_save(self): ...
    def request_finished(self, request, block_ids): ...
    @classmethod
    def build_kv_connector_stats(cls, data=None): ...
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config): ...
    def get_finished(self, finished_req_ids): ...
    def shutdown(self): ...
'''
GOOD = '''
class Ours(Base):
    def __init__(self, vllm_config, role, kv_cache_config=None): ...
    def start_load_kv(self, forward_context, **kwargs): ...
    def wait_for_save(self): ...
    def request_finished(self, request, block_ids, extra=None): ...
    @classmethod
    def build_kv_connector_stats(cls, **kwargs): ...
    @classmethod
    def supports_sleep_mode(cls, *args, **kwargs): ...
    def get_finished(self, finished_req_ids, *args, **kwargs): ...
    def _private(self, anything): ...
'''
BAD = '''
class Ours(Base):
    def __init__(self, vllm_config, role): ...
    def start_load_kv(self, forward_context): ...
    def request_finished(self, request, blocks): ...
    def build_kv_connector_stats(cls, data=None): ...
    @classmethod
    def supports_sleep_mode(cls, *args): ...
    def get_finished(self, finished_req_ids, more): ...
    @staticmethod
    def shutdown(): ...
'''


def _check(ours: str, hooks: tuple[str, ...] = ()) -> list[str]:
    return vs.compare("9.9.9", vs.classes(BASE)["Base"], vs.classes(ours)["Ours"], hooks)


def test_checker_accepts_compatible_overrides() -> None:
    assert _check(GOOD, ("start_load_kv", "shutdown")) == []


def test_checker_reports_each_mismatch() -> None:
    problems = _check(BAD, ("start_load_kv", "get_kv_connector_stats"))
    expected = {
        "Ours.__init__: lacks the base's parameter 'kv_cache_config'",
        "Ours.start_load_kv: has no **kwargs",
        "Ours.request_finished: parameter 2 is 'blocks', the base's is 'block_ids'",
        "Ours.build_kv_connector_stats: decorated plain, the base's is ['classmethod']",
        "Ours.supports_sleep_mode: lacks the base's parameter 'kv_transfer_config' and has no *args and **kwargs",
        "Ours.get_finished: requires parameter 'more'",
        "Ours.shutdown: decorated ['staticmethod'], the base's is plain",
        "Ours does not define wait_for_save, abstract in Base",
        "Base has no get_kv_connector_stats, a hook kvshuttle relies on",
    }
    for text in expected:
        assert any(text in p for p in problems), f"not reported: {text!r}\nreported:\n" + "\n".join(problems)
    assert all(p.startswith("vLLM 9.9.9: ") for p in problems)
    assert len(problems) == len(expected), "\n".join(problems)


def test_checker_reports_a_missing_base_class() -> None:
    problems = _check("class Ours(Other):\n    pass\n")
    assert any("does not subclass Base" in p for p in problems), problems


def test_wheel_reader_takes_the_newest_of_the_line(tmp_path: Path) -> None:
    for name, text in [("vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl", "V = '0.33.0'\n"),
                       ("vllm-0.33.2-cp38-abi3-manylinux_2_28_x86_64.whl", "V = '0.33.2'\n"),
                       ("vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl", "V = '0.34.0'\n"),
                       ("other-0.33.9-py3-none-any.whl", "V = 'other'\n")]:
        with zipfile.ZipFile(tmp_path / name, "w") as z:
            z.writestr(vs.BASE_MEMBER, text)
    source = vs.wheel_base("0.33", str(tmp_path))
    assert source is not None and source.version == "0.33.2" and "0.33.2" in source.text
    assert vs.wheel_base("0.31", str(tmp_path)) is None
    assert vs.wheel_base("0.33", str(tmp_path / "absent")) is None


def test_wheel_reader_fails_when_the_base_moved(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "vllm-0.35.0-cp38-abi3-manylinux_2_28_x86_64.whl", "w") as z:
        z.writestr("vllm/elsewhere.py", "")
    with pytest.raises(AssertionError, match="the connector base moved"):
        vs.wheel_base("0.35", str(tmp_path))
