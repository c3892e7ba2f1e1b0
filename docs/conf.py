"""Sphinx configuration of the omni-cache reference: `bash docs/build.sh` builds it.

The API pages are generated from the docstrings: ``api/index.rst`` lists every public name of
``omni_cache_cuda`` (its ``__all__``) and of ``omni_cache_cuda.metrics``, and autosummary writes
one page per name. Both are rewritten at every build, so a new public name gets its page without an
edit here.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))

project = "omni-cache"
author = "omni-cache maintainers"
copyright = "omni-cache maintainers"
release = importlib.metadata.version("omni-cache")

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
templates_path = ["_templates"]
exclude_patterns = ["_build"]
root_doc = "index"
html_theme = "alabaster"
html_title = f"omni-cache {release}"
html_theme_options = {"page_width": "1100px", "sidebar_width": "260px"}

# Google-style docstrings (Args, Returns, Raises, Attributes).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
napoleon_use_rtype = False

autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autoclass_content = "class"
autodoc_typehints_format = "short"
# `name` in a docstring is a cross-reference to a documented object when one exists.
default_role = "py:obj"
# Every cross-reference must resolve, except those to libraries whose inventories a build
# without network cannot fetch.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|attrs|prometheus_client|concurrent|threading|collections)\b.*"),
    (r"py:.*", r"(typing|types|enum|abc|collections\.abc|os)\..*"),
    (r"py:class", r"(Any|Mapping|Sequence|Iterable|Iterator|Callable|MappingProxyType)"),
    (r"py:class", r"(NewType|Enum|Exception|BaseException|ValueError|RuntimeError)"),
    (r"py:class", r"(AssertionError|ImportError|object|int|str|float|bool|bytes)"),
    (r"py:class", r"(Tensor|ndarray|Metric|Collector|CollectorRegistry)"),
    (r"py:class", r"omni_cache_(core|cuda)\._\w+\..*"),
    (r"py:obj", r"omni_cache_(core|cuda)\._\w+\..*"),
]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# The pages of the public names, in the order of the packages' __all__.
PACKAGES = {
    "omni_cache_cuda": "The engine-facing API",
    "omni_cache_cuda.metrics": "Prometheus metrics (needs the ``metrics`` extra)",
    "omni_cache_cuda.vllm": "In vLLM: the drop-in worker's switch, its files and the glue",
}


def _write_api_index() -> None:
    lines = [
        "API reference",
        "=============",
        "",
        "One page per public name, generated from the docstrings. ``omni_cache_cuda``",
        "re-exports the contract types of the pure core ``omni_cache_core``, so every name an",
        "engine needs is importable from it.",
        "",
    ]
    for package, title in PACKAGES.items():
        module = importlib.import_module(package)
        lines += [title, "-" * len(title), "", f".. automodule:: {package}", "   :no-members:", ""]
        lines += [f".. currentmodule:: {package}", ""]
        lines += [".. autosummary::", "   :toctree: .", "   :nosignatures:", ""]
        lines += [f"   {name}" for name in module.__all__]
        lines.append("")
    api = DOCS / "api"
    api.mkdir(exist_ok=True)
    text = "\n".join(lines)
    index = api / "index.rst"
    if not index.exists() or index.read_text() != text:
        index.write_text(text)


_write_api_index()


# ---------------------------------------------------------------------------------------------
# Two adaptations to how the docstrings are written.

#: A bare snake_case name: a parameter or field, written `name` in the docstrings.
_PLAIN_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


def _resolve_by_suffix(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """Resolve `NAME` written in a docstring (the default role, ``py:obj``).

    The docstrings use single backticks both for documented objects and for parameter names.
    A target that no plain lookup finds is linked to the one documented object whose dotted
    name ends with it (`JOIN_ON_FINISH` in `PrefixCacheConfig`'s docstring is
    `WriteSchedule.JOIN_ON_FINISH`); a bare snake_case name (a parameter such as `key`) is shown
    as code. Anything else stays unresolved, and the nitpicky build fails on it.
    """
    if node.get("refdomain") != "py" or node.get("reftype") != "obj":
        return None
    target = node["reftarget"].lstrip("~.")
    domain = env.get_domain("py")
    matches = [
        name
        for name in domain.objects
        if name.endswith("." + target) and not any(p.startswith("_") for p in name.split("."))
    ]
    if len(matches) == 1:
        return domain.resolve_xref(
            env, node["refdoc"], app.builder, "obj", matches[0], node, contnode
        )
    if _PLAIN_NAME.match(target):
        return contnode
    return None


def _napoleon_for_code_objects(app: Any) -> None:
    """Run napoleon on modules, classes and functions only, not on attribute docstrings.

    Napoleon reads an attribute's or property's first line ``Rows of every host mirror: ...``
    as ``type: description``; these docstrings are prose.
    """
    from sphinx.ext.napoleon import _process_docstring

    listeners = app.events.listeners["autodoc-process-docstring"]
    for listener in list(listeners):
        if listener.handler is _process_docstring:
            app.disconnect(listener.id)

    def process(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
        if what not in ("attribute", "property", "data"):
            _process_docstring(app, what, name, obj, options, lines)

    app.connect("autodoc-process-docstring", process)


def setup(app: Any) -> None:
    """Connect the two adaptations above."""
    app.connect("builder-inited", _napoleon_for_code_objects)
    app.connect("missing-reference", _resolve_by_suffix)
