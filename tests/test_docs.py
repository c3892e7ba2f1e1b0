"""The guide's code compiles and names only what the package exports; the README links it.

The reference itself is built, warnings failing it, by `bash docs/build.sh` (a CI step).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import omni_cache_cuda

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)


def test_the_guide_code_compiles():
    """Every Python block of the guide is valid Python."""
    blocks = _python_blocks()
    assert len(blocks) >= 5
    for block in blocks:
        compile(block, str(GUIDE), "exec")


def test_the_guide_imports_only_exported_names():
    """Each name the guide imports from the package exists there."""
    imported = 0
    for block in _python_blocks():
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module == "omni_cache_cuda":
                for alias in node.names:
                    assert alias.name in omni_cache_cuda.__all__, alias.name
                    imported += 1
            elif isinstance(node, ast.ImportFrom) and node.module == "omni_cache_cuda.metrics":
                from omni_cache_cuda import metrics

                for alias in node.names:
                    assert alias.name in metrics.__all__, alias.name
    assert imported >= 5


def test_the_readme_links_the_guide():
    """The README points at the guide and the docs build."""
    readme = (ROOT / "README.md").read_text()
    assert "(docs/guide.md)" in readme
    assert "bash docs/build.sh" in readme
