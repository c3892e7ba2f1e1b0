"""The core stays sans-IO: no torch, threads, clocks, OS access, randomness or sockets (SPEC 11)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import omni_cache_core

CORE_DIR = Path(omni_cache_core.__file__).resolve().parent

#: Top-level modules the core must never import. numpy is allowed (vectorized slot tables).
BANNED = frozenset(
    {
        "torch",
        "threading",
        "time",
        "os",
        "random",
        "socket",
        "subprocess",
        "asyncio",
        "concurrent",
    }
)

#: Calls that import a module named by a string.
_DYNAMIC_IMPORTS = frozenset({"__import__", "import_module"})


def banned_imports(source: str, filename: str = "<source>") -> list[str]:
    """List every import of a banned module in `source`, as ``file:line: module``.

    Imports anywhere count: at the top, inside functions, under ``if TYPE_CHECKING`` or ``try``,
    and dynamic ``__import__("x")`` / ``importlib.import_module("x")`` calls with a literal name.
    Relative imports stay inside the package and are allowed.
    """
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            func_name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if (
                func_name in _DYNAMIC_IMPORTS
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                names = [first.value]
        found += [
            f"{filename}:{node.lineno}: {name}" for name in names if name.split(".")[0] in BANNED
        ]
    return found


def test_scanner_finds_every_kind_of_banned_import() -> None:
    """The scanner flags banned imports in every syntactic form, so a clean scan means something."""
    source = textwrap.dedent(
        """
        import numpy as np
        import torch
        from os import path
        import concurrent.futures as cf
        from . import _errors
        from .time import helper
        import importlib

        def f():
            import threading
            return __import__("random")

        try:
            from asyncio import sleep
        except ImportError:
            pass

        mod = importlib.import_module("socket")
        """
    )
    found = banned_imports(source, "probe.py")
    modules = sorted(line.rsplit(": ", 1)[1] for line in found)
    assert modules == [
        "asyncio",
        "concurrent.futures",
        "os",
        "random",
        "socket",
        "threading",
        "torch",
    ]
    assert "probe.py:3: torch" in found


def test_core_sources_import_nothing_banned() -> None:
    """No source file of the core imports torch, threading, time, os, random or other I/O."""
    files = sorted(CORE_DIR.rglob("*.py"))
    assert CORE_DIR / "__init__.py" in files
    assert CORE_DIR / "_contract.py" in files
    found: list[str] = []
    for path in files:
        found += banned_imports(path.read_text(encoding="utf-8"), str(path.relative_to(CORE_DIR)))
    assert found == []


_BLOCKED_IMPORT_PROBE = """
import importlib.abc
import sys


class BlockTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torch" or fullname.startswith("torch."):
            raise ImportError(f"{fullname} is blocked in this probe")
        return None


sys.meta_path.insert(0, BlockTorch())
before = set(sys.modules)
import omni_cache_core
import omni_cache_core._contract
import omni_cache_core._errors

config = omni_cache_core.PrefixCacheConfig(num_blocks=4, block_size=2)
assert config.num_slots == 8
loaded = set(sys.modules) - before
assert not any(m == "torch" or m.startswith("torch.") for m in loaded), sorted(loaded)

# Control: the blocker really works, so the import above really ran without torch.
try:
    import torch
except ImportError:
    print("core imported without torch")
else:
    raise SystemExit("the torch blocker did not block")
"""


def test_core_imports_when_torch_is_unimportable() -> None:
    """The core package imports and works in a process where importing torch fails."""
    result = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "core imported without torch" in result.stdout
