"""The package's imports: no import circle, no private name taken across modules, the extension behind one door.

Read from the source with ``ast`` (nothing is imported), counting every import: at the top, inside functions
(lazy) and under ``TYPE_CHECKING``: a circle hidden by a lazy import is still two modules that cannot be
understood, tested or moved one without the other. A name starting with ``_`` is private to its module: another
module neither imports it (``from x import _y``) nor reaches it through a module (``x._y``); a private module
(``_nixl``, ``_checks``) is imported only inside its own package, and the compiled ``_native`` only by
``core/native.py``.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "python"
PACKAGE = "kvshuttle"

# Known debts, each owned elsewhere: shrink these lists once paid, never grow them.
KNOWN_CIRCLES: set[frozenset[str]] = set()
KNOWN_PRIVATE: set[tuple[str, str]] = {  # (user, module whose private names it takes)
}
# Importers of the extension besides core/native.py: the pack bench and the schema read and tune the native
# pool; executors.py annotates with _native.CopyTicket (core.native re-exports it).
KNOWN_NATIVE = {"kvshuttle.bench.pack", "kvshuttle.bench.schema", "kvshuttle.transfer.executors"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package); ``_native`` (compiled) from its stub."""
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    found[f"{PACKAGE}._native"] = (ROOT / PACKAGE / "_native.pyi", False)
    return found


MODULES = _modules()


@functools.cache
def _tree(name: str) -> ast.Module:
    return ast.parse(MODULES[name][0].read_text("utf-8"))


def _imports(name: str) -> Iterator[tuple[str, str | None, ast.AST]]:
    """``(module, imported name or None, node)`` for every import of a package module in ``name``'s source."""
    is_package = MODULES[name][1]
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    yield alias.name, None, node
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if module.split(".")[0] == PACKAGE:
                for alias in node.names:
                    yield module, alias.name, node


@functools.cache
def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for module, imported, _ in _imports(name):
            target = f"{module}.{imported}" if imported and f"{module}.{imported}" in MODULES else module
            if target in MODULES and target != name:
                edges[name].add(target)
    return edges


def _circles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: set[frozenset[str]] = set()
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    group.add(top)
                    if top == node:
                        break
                if len(group) > 1:
                    circles.add(frozenset(group))
    return circles


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(name: str) -> Iterator[str]:
    """``module.name`` of every private name ``name``'s source takes from another module of the package."""
    aliases: dict[str, str] = {}  # local name -> package module it stands for
    for module, imported, node in _imports(name):
        if imported is None:
            assert isinstance(node, ast.Import)
            for alias in node.names:
                if alias.name == module and alias.asname:
                    aliases[alias.asname] = module
        elif f"{module}.{imported}" in MODULES:
            local = next(a.asname or a.name for a in node.names if a.name == imported)  # type: ignore[attr-defined]
            aliases[local] = f"{module}.{imported}"
        elif _private(imported) and module != name:
            yield f"{module}.{imported}"
    for node in ast.walk(_tree(name)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and _private(node.attr) and aliases[node.value.id] != name):
            yield f"{aliases[node.value.id]}.{node.attr}"


def test_the_finder_sees_a_circle_and_a_private_import() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}
    assert _circles({"a": {"b"}, "b": set()}) == set()
    assert "kvshuttle.core.ops" in _graph()["kvshuttle"]  # the package re-exports pack / unpack


def test_no_import_circle() -> None:
    found = _circles(_graph())
    new = found - KNOWN_CIRCLES
    assert not new, "import circles (cut one module's dependency on the other along its seam): " + "; ".join(
        " <-> ".join(sorted(c)) for c in sorted(new, key=sorted))


def test_no_private_name_across_modules() -> None:
    taken = {(name, used) for name in MODULES for used in _private_uses(name)
             if (name, used.rsplit(".", 1)[0]) not in KNOWN_PRIVATE}
    assert not taken, "private names used by other modules (give them a public interface): " + "; ".join(
        f"{name} uses {used}" for name, used in sorted(taken))


def test_private_modules_stay_in_their_package() -> None:
    wrong = []
    for name in MODULES:
        for target in _graph()[name]:
            leaf = target.rsplit(".", 1)[-1]
            if not _private(leaf):
                continue
            if target == f"{PACKAGE}._native":
                if name not in ("kvshuttle.core.native", *KNOWN_NATIVE):
                    wrong.append(f"{name} imports the extension (only core/native.py does: use core.native.ext)")
            elif not name.startswith(target.rsplit(".", 1)[0] + "."):
                wrong.append(f"{name} imports {target}, private to its package")
    assert not wrong, wrong
