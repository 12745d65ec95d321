"""What a stored result was computed by: code fingerprints, library versions, stable hashes.

A cache or a stored result is keyed by exactly what it depends on. For code that is a
**fingerprint narrowed to the modules that compute it**: ``code_fingerprint(roots)`` hashes the
named root modules and every module they import, transitively, within the computational
packages (``metrics``, ``methods``, ``benchmark.core``; not the store, which moves bytes and
does not compute them, and not the runners, which only orchestrate). Each module counts by its
syntax tree without docstrings, so an edit to a docstring or a comment changes no fingerprint,
while a change to any statement of any module on the path does. ``from package import name``
counts only the submodule that defines ``name`` (a package's ``__init__`` re-exports are
followed), so a fix in ``methods/swag.py`` does not touch the fingerprint of the dropout samples.

The library versions (``library_versions``) go into every key beside the fingerprint.
"""
from __future__ import annotations

import ast
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
NOT_COMPUTATIONAL = ("benchmark.core.store",)  # file I/O and validation: versioned by its file format
LIBRARIES = ("torch", "torchvision", "numpy", "scipy", "safetensors", "laplace-torch", "blitz-bayesian-pytorch",
             "cvxpy", "numba")


def stable_hash(payload: Any, length: int = 16) -> str:
    """Hex SHA-256 prefix of ``payload`` as key-sorted JSON: the same settings, the same hash
    (enums hash by their value, other non-JSON values by ``str``)."""
    text = json.dumps(payload, sort_keys=True, default=lambda v: getattr(v, "value", str(v)))
    return hashlib.sha256(text.encode()).hexdigest()[:length]


@functools.lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    """Python's version and those of the numerical libraries results depend on (``LIBRARIES``;
    ``"absent"`` for one that is not installed). Recorded in every stored file's metadata."""
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


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


@functools.lru_cache(maxsize=None)
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


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
    found = set()
    for node in ast.walk(_parsed(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if module_file(alias.name, root))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and module_file(node.module, root):
            found.update(_resolve(node.module, alias.name, root) for alias in node.names)
    return found


def closure(roots: Iterable[str], root: Path | None = None) -> list[str]:
    """``roots`` and the computational modules they import, transitively (sorted); read under
    ``root`` (default ``SOURCE_ROOT``)."""
    root = root or SOURCE_ROOT
    seen: set[str] = set()
    todo = list(roots)
    roots = set(todo)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if (_root_file(name, root) if name in roots else module_file(name, root)) is None:
            raise ValueError(f"code_fingerprint: {name!r} is not a module under {root} nor a loaded module")
        seen.add(name)
        todo += [d for d in dependencies(name, root)
                 if d not in seen and _within(d, COMPUTATIONAL) and not _within(d, NOT_COMPUTATIONAL)]
    return sorted(seen)


def code_fingerprint(roots: tuple[str, ...]) -> str:
    """Hex digest of the code of ``roots`` (module names) and of the computational modules they
    import, transitively (``closure``), docstrings left out; then ``library_versions``. The sources
    are read under ``SOURCE_ROOT``, once per process."""
    return _fingerprint(tuple(roots), SOURCE_ROOT)


@functools.lru_cache(maxsize=None)
def _fingerprint(roots: tuple[str, ...], root: Path) -> str:
    digest = hashlib.sha256()
    for name in closure(roots, root):
        digest.update(name.encode())
        digest.update(_without_docstrings(_parsed(_root_file(name, root))).encode())
    digest.update(json.dumps(library_versions(), sort_keys=True).encode())
    return digest.hexdigest()[:16]


def forget() -> None:
    """Drop the parsed sources and fingerprints this process remembers (tests that edit code)."""
    _parsed.cache_clear()
    _fingerprint.cache_clear()
