"""What a stored result was computed by: code fingerprints, library versions, stable hashes.

A cache or a stored result is keyed by exactly what it depends on. For code that is a
**fingerprint narrowed to the modules that compute it**: ``code_fingerprint(roots)`` hashes the
named root modules and every module they import, transitively, within the computational
packages (``metrics``, ``methods``, ``benchmark.core``, the store included: its readers, writers
and stacking shape what a method gets and gives; not the runners, which only orchestrate). Each module counts by its
syntax tree without docstrings, so an edit to a docstring or a comment changes no fingerprint,
while a change to any statement of any module on the path does. ``from package import name``
counts only the submodule that defines ``name`` (a package's ``__init__`` re-exports are
followed), so a fix in ``methods/swag.py`` does not touch the fingerprint of the dropout samples.

Every key also holds Python's version and the versions of exactly the distributions its modules
import (``library_versions``): each module's top-level third-party imports, function-level ones
included, mapped to their distributions (``importlib.metadata.packages_distributions``). A library
enters a key only when a module the key hashes imports it, so its upgrade recomputes what that
code computes and nothing else.

Two kinds of key, so that no module can be missed silently:

- **cheap caches** (the reference's canonical, aligned and predictive forms, the evaluate
  numbers) are keyed by the **whole computational source** (``source_fingerprint``: every module
  of ``SOURCE_PACKAGES`` but the figure style and writer, ``SOURCE_EXCLUDED``), so
  that any edit anywhere recomputes them, whatever reaches what;
- **expensive artifacts** (samples, HMC chains) keep the narrowing of ``code_fingerprint``; a
  root may name a package, which counts every module under it (``benchmark.core.data``: what is
  reached through data and config, not imports). ``tests/methods/test_provenance.py`` edits
  every module in turn and checks the narrowed keys against what a run really executes.

Every key names modules by their dotted name, never by a path: moving a store or a checkout
changes no key.
"""
from __future__ import annotations

import ast
import fnmatch
import functools
import hashlib
import importlib.metadata
import json
import platform
import sys
from pathlib import Path
from typing import Any, Iterable

SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""Where the project's packages are read from (the repository; tests point it at an edited copy)."""
COMPUTATIONAL = ("metrics", "methods", "benchmark.core")  # packages whose code computes results
SOURCE_PACKAGES = ("metrics", "methods", "benchmark.core", "benchmark.config", "benchmark.experiment",
                   "benchmark.inventory", "benchmark.references", "benchmark.baselines", "benchmark.design")
"""The whole computational source: what ``source_fingerprint`` (the cheap caches' key) hashes,
but ``SOURCE_EXCLUDED``."""
SOURCE_EXCLUDED = ("benchmark.core.figures", "benchmark.core.figures.*")
"""Modules of ``SOURCE_PACKAGES`` that ``source_fingerprint`` leaves out (``fnmatch`` patterns of
dotted names): the figure style and writer (``benchmark.core.figures``), which draw numbers already
computed and never compute a cached one, so that editing them (or upgrading matplotlib) recomputes no
cache. A reference's report and figure hooks (``Reference.hooks``) are modules of the report and the
analyses, outside ``SOURCE_PACKAGES``; the reference's own module (its scoring) is in."""
PROJECT = frozenset(package.split(".")[0] for package in SOURCE_PACKAGES)
"""The project's top-level packages: never a library, wherever they are read from."""


def stable_hash(payload: Any, length: int = 16) -> str:
    """Hex SHA-256 prefix of ``payload`` as key-sorted JSON: the same settings, the same hash
    (enums hash by their value, other non-JSON values by ``str``)."""
    text = json.dumps(payload, sort_keys=True, default=lambda v: getattr(v, "value", str(v)))
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def library_versions(modules: Iterable[str] | None = None) -> dict[str, str]:
    """Python's version and, by distribution name, the versions of the distributions ``modules``
    import (``libraries``; default: every module of ``source_modules``, what ``source_fingerprint``
    hashes); ``"absent"`` for an imported name that no installed distribution provides. What every
    key holds beside its code, and what stored metadata records."""
    root = SOURCE_ROOT
    modules = source_modules(root) if modules is None else modules
    return {"python": platform.python_version(), **distribution_versions(libraries(modules, root))}


def distribution_versions(names: Iterable[str]) -> dict[str, str]:
    """Distribution name -> version of the distributions that provide the top-level import
    ``names`` (``sklearn`` -> ``scikit-learn``); a name no installed distribution provides counts
    as itself, ``"absent"``."""
    provided = _packages_distributions()
    versions = {}
    for name in names:
        for distribution in provided.get(name, [name]):
            versions[distribution] = _version(distribution)
    return dict(sorted(versions.items()))


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> dict[str, list[str]]:
    return {name: sorted(set(found)) for name, found in importlib.metadata.packages_distributions().items()}


@functools.lru_cache(maxsize=None)
def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def libraries(modules: Iterable[str], root: Path | None = None) -> set[str]:
    """The top-level names of the third-party modules that ``modules`` (project modules under
    ``root``, default ``SOURCE_ROOT``, or loaded root modules) import, function-level imports
    included: neither the standard library's nor the project's."""
    root = root or SOURCE_ROOT
    found: set[str] = set()
    for name in modules:
        path = _root_file(name, root)
        if path is not None:
            found |= _libraries_at(root, _stamp(path))
    return found


@functools.lru_cache(maxsize=None)
def _libraries_at(root: Path, stamp: tuple[Path, int, int]) -> frozenset[str]:
    found = set()
    for node in ast.walk(_parsed_at(stamp)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return frozenset(name for name in found if name != "__future__" and name not in sys.stdlib_module_names
                     and name not in PROJECT and module_file(name, root) is None)


def _within(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def module_file(name: str, root: Path) -> Path | None:
    """The source file of project module ``name`` under ``root`` (``a.b`` -> ``a/b.py`` or
    ``a/b/__init__.py``), or ``None`` when it is not a project module."""
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _root_file(name: str, root: Path) -> Path | None:
    """The source of a root module: under ``root``, or, for a module loaded from elsewhere (a
    plugin's method registered with ``register_method``), the file it was loaded from."""
    path = module_file(name, root)
    if path is None and name in sys.modules:
        loaded = getattr(sys.modules[name], "__file__", None)
        path = Path(loaded) if loaded and loaded.endswith(".py") else None
    return path


def _stamp(path: Path) -> tuple[Path, int, int]:
    """``path`` with its mtime and size: the cache key of what is read from it (an edited source
    is read again)."""
    stat = path.stat()
    return path, stat.st_mtime_ns, stat.st_size


def _parsed(path: Path) -> ast.Module:
    return _parsed_at(_stamp(path))


@functools.lru_cache(maxsize=None)
def _parsed_at(stamp: tuple[Path, int, int]) -> ast.Module:
    return ast.parse(stamp[0].read_text(encoding="utf-8"), str(stamp[0]))


def _module_digest(path: Path) -> str:
    """SHA-256 of the syntax tree of ``path`` without docstrings (cached per version of the file)."""
    return _digest_at(_stamp(path))


@functools.lru_cache(maxsize=None)
def _digest_at(stamp: tuple[Path, int, int]) -> str:
    return hashlib.sha256(_without_docstrings(_parsed_at(stamp)).encode()).hexdigest()


def _without_docstrings(tree: ast.Module) -> str:
    """``ast.dump`` of ``tree`` with every module, class and function docstring removed."""
    tree = ast.parse(ast.unparse(tree))  # a private copy to edit
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def _resolve(package: str, name: str, root: Path) -> str:
    """The module that defines ``name`` imported as ``from package import name``: the submodule
    ``package.name``, or the submodule the package's ``__init__`` re-exports it from, or the
    package itself."""
    if module_file(f"{package}.{name}", root) is not None:
        return f"{package}.{name}"
    init = module_file(package, root)
    if init is None or init.name != "__init__.py":
        return package
    for node in _parsed(init).body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and _within(node.module, (package,)) and node.module != package:
            if any((alias.asname or alias.name) == name for alias in node.names):
                source = next(alias.name for alias in node.names if (alias.asname or alias.name) == name)
                return _resolve(node.module, source, root)
    return package


def dependencies(name: str, root: Path) -> set[str]:
    """Project modules that module ``name`` imports directly (function-level imports included),
    each resolved to the module defining the imported name."""
    path = _root_file(name, root)
    if path is None:
        return set()
    return set(_dependencies_at(name, root, _stamp(path)))


@functools.lru_cache(maxsize=None)
def _dependencies_at(name: str, root: Path, stamp: tuple[Path, int, int]) -> frozenset[str]:
    path = stamp[0]
    found = set()
    for node in ast.walk(_parsed(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if module_file(alias.name, root))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and module_file(node.module, root):
            found.update(_resolve(node.module, alias.name, root) for alias in node.names)
    return frozenset(found)


def closure(roots: Iterable[str], root: Path | None = None) -> list[str]:
    """``roots`` and the computational modules they import, transitively, with the ``__init__`` of
    every package above them (sorted); read under ``root`` (default ``SOURCE_ROOT``). A root that
    is a package counts every module under it."""
    root = root or SOURCE_ROOT
    seen: set[str] = set()
    todo = [m for name in roots for m in (package_modules(name, root) if module_file(name, root) is not None
                                          and module_file(name, root).name == "__init__.py" else [name])]
    roots = set(todo)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if (_root_file(name, root) if name in roots else module_file(name, root)) is None:
            raise ValueError(f"code_fingerprint: {name!r} is not a module under {root} nor a loaded module")
        seen.add(name)
        todo += [d for d in dependencies(name, root)
                 if d not in seen and _within(d, COMPUTATIONAL)]
    # Importing a module runs the __init__ of each package above it: counted too, by its own code
    # only (its imports are the package's re-exports, which would tie every module to every other).
    for name in list(seen):
        parts = name.split(".")
        for i in range(1, len(parts)):
            package = ".".join(parts[:i])
            path = module_file(package, root)
            if path is not None and path.name == "__init__.py" and _within(package, COMPUTATIONAL):
                seen.add(package)
    return sorted(seen)


def package_modules(name: str, root: Path | None = None) -> list[str]:
    """Every module of package ``name`` under ``root`` (default ``SOURCE_ROOT``), itself included,
    sorted; ``[name]`` for a plain module; ``[]`` when it is neither."""
    root = root or SOURCE_ROOT
    base = root.joinpath(*name.split("."))
    if (base / "__init__.py").is_file():
        found = []
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        return sorted(found)
    return [name] if module_file(name, root) is not None else []


def source_modules(root: Path | None = None) -> list[str]:
    """Every module of ``SOURCE_PACKAGES`` under ``root`` (default ``SOURCE_ROOT``) but those
    ``SOURCE_EXCLUDED`` matches, sorted: what ``source_fingerprint`` hashes."""
    root = root or SOURCE_ROOT
    found = {m for package in SOURCE_PACKAGES for m in package_modules(package, root)}
    return sorted(m for m in found if not any(fnmatch.fnmatchcase(m, pattern) for pattern in SOURCE_EXCLUDED))


def source_fingerprint() -> str:
    """Hex digest of every module of ``source_modules`` (docstrings left out, keyed by dotted
    name: no path) and of ``library_versions`` of those modules (the distributions they import):
    the key of the cheap caches, which any edit of the computational source recomputes."""
    root = SOURCE_ROOT
    modules = source_modules(root)
    digest = hashlib.sha256()
    for name in modules:
        digest.update(name.encode())
        digest.update(_module_digest(module_file(name, root)).encode())
    digest.update(json.dumps(library_versions(modules), sort_keys=True).encode())
    return digest.hexdigest()[:16]


def code_fingerprint(roots: tuple[str, ...]) -> str:
    """Hex digest of the code of ``roots`` (module or package names) and of the computational
    modules they import, transitively (``closure``), docstrings left out, each named by its dotted
    name (no path); then ``library_versions`` of those modules (the distributions they import).
    The sources are read under ``SOURCE_ROOT``, again whenever one changes on disk."""
    root = SOURCE_ROOT
    modules = closure(tuple(roots), root)
    digest = hashlib.sha256()
    for name in modules:
        digest.update(name.encode())
        digest.update(_module_digest(_root_file(name, root)).encode())
    digest.update(json.dumps(library_versions(modules), sort_keys=True).encode())
    return digest.hexdigest()[:16]
