"""The rule map (spec/RULES.md) covers every SPEC rule id and names only tests and code that exist."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "spec" / "SPEC.md"
RULES = ROOT / "spec" / "RULES.md"

RULE_ID = r"(?:STEP|PAGE|SLOT|TASK|BUDGET|HIT|OUT|FAIL|CONC|DEV|LIFE|DLV|SPEC)-\d+"
DECISION_ID = r"D\d+"
#: A rule is defined by a bullet that starts with its id ("- STEP-1 Every save ...").
SPEC_BULLET = re.compile(rf"^\s*[-*]\s+({RULE_ID})\b", re.MULTILINE)
#: A table row of the rule map: ``| RULE | owner | where | tests |``.
ROW = re.compile(rf"^\|\s*({RULE_ID}|{DECISION_ID}|invariants)\s*\|(.*)\|\s*$", re.MULTILINE)
#: A named test: ``tests/file.py::name``, a parametrized id (``name[inline]``) reduced to the name.
TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+)(?:\[[^\]]*\])?")
#: Marks a test that needs a CUDA device (CI has none, so it never runs there).
GPU_MARK = "(GPU)"
#: The old placeholder for adapter tests; none may remain.
PLACEHOLDER = "(adapter tests)"
#: Marks a rule that no test checks yet; `UNTESTED` must list exactly these rules.
UNTESTED_MARK = "(no test yet)"
#: Rules no test checks yet (spec/RULES.md, "Known gaps", says what each one needs). A rule that
#: gets a test loses its mark there and its entry here.
UNTESTED: frozenset[str] = frozenset()
OWNERS = {"core", "omni_cache_cuda", "both"}
PACKAGES = {"core": "omni_cache_core", "adapter": "omni_cache_cuda"}
#: A code reference in an "enforced in" cell: ``_module.Name`` or ``_module.Class.method``, or
#: the same in the adapter's vLLM subpackage (``vllm._module.Name``, ``vllm.worker.Name``).
CODE_REF = re.compile(r"`((?:vllm\.\w+|_\w+)(?:\.\w+)+)`")
#: A test file of the adapter whose tests' docstrings name the rules they check.
ADAPTER_TEST_FILES = (
    "tests/test_adapter_scenarios.py",
    "tests/test_adapter_concurrency.py",
    "tests/test_adapter_resume.py",
    "tests/test_adapter_speculative.py",
    "tests/test_adapter_stateful.py",
    "tests/gpu/test_gpu_conformance.py",
    "tests/test_readme_example.py",
    "tests/test_demo.py",
)


def spec_rule_ids(spec_text: str) -> list[str]:
    """The rule ids SPEC defines, in order of appearance."""
    return SPEC_BULLET.findall(spec_text)


def map_rows(rules_text: str) -> dict[str, list[str]]:
    """Each row of the rule map by its first cell, as the list of its remaining cells."""
    rows: dict[str, list[str]] = {}
    for match in ROW.finditer(rules_text):
        ident = match.group(1)
        if ident in rows:
            raise AssertionError(f"spec/RULES.md has two rows for {ident}")
        rows[ident] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def named_tests(tests_cell: str) -> list[tuple[str, str, bool]]:
    """The ``(file, test name, marked GPU)`` triples a tests cell names, one entry per line."""
    refs: list[tuple[str, str, bool]] = []
    for entry in tests_cell.split("<br>"):
        refs.extend((path, name, GPU_MARK in entry) for path, name in TEST_REF.findall(entry))
    return refs


def checked_tests(tests_cell: str) -> list[tuple[str, str]]:
    """The ``(file, test name)`` pairs a tests cell names."""
    return [(path, name) for path, name, _ in named_tests(tests_cell)]


@cache
def _module_body(file: Path) -> list[ast.stmt]:
    """The top-level statements of a Python file, parsed once per run."""
    return ast.parse(file.read_text()).body


def _tests_in(file: Path) -> dict[str, bool]:
    """Module-level tests of a file and whether each carries the ``gpu`` mark.

    A test is a ``def test_...`` function, a ``class Test...``, or a ``Test... = ...`` binding
    (how a hypothesis state machine becomes a test case). A missing file has no tests.
    """
    if not file.is_file():
        return {}
    tests: dict[str, bool] = {}
    for node in _module_body(file):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            marks = {ast.unparse(d).split("(")[0] for d in node.decorator_list}
            tests[node.name] = "pytest.mark.gpu" in marks
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    tests[target.id] = False
    return {name: gpu for name, gpu in tests.items() if name.startswith(("test_", "Test"))}


def missing_tests(refs: list[tuple[str, str]], root: Path) -> list[str]:
    """The references whose file or test does not exist under `root`."""
    return [f"{path}::{name}" for path, name in refs if name not in _tests_in(root / path)]


def wrong_gpu_marks(refs: list[tuple[str, str, bool]], root: Path) -> list[str]:
    """The references marked (GPU) that need no GPU, or needing one and not marked."""
    wrong = []
    for path, name, marked in refs:
        tests = _tests_in(root / path)
        if name in tests and tests[name] != marked:
            wrong.append(f"{path}::{name} {'is' if marked else 'is not'} marked {GPU_MARK}")
    return wrong


def code_refs(owner: str, where: str) -> list[tuple[str, str]]:
    """The ``(package, dotted name)`` pairs an "enforced in" cell names.

    Names after ``core:`` are in omni_cache_core and after ``adapter:`` in omni_cache_cuda;
    names before either prefix are in the owner's package (the core's for "both").
    """
    refs: list[tuple[str, str]] = []
    package = PACKAGES["adapter" if owner == "omni_cache_cuda" else "core"]
    for part in re.split(r"\b(core|adapter):", where):
        if part in PACKAGES:
            package = PACKAGES[part]
            continue
        refs.extend((package, name) for name in CODE_REF.findall(part))
    return refs


def resolves(package: str, dotted: str, root: Path) -> bool:
    """Whether ``_module.Name[.attr]`` names a class, function or binding in the package."""
    module, *names = dotted.split(".")
    if module == "vllm":  # the adapter's vLLM subpackage
        module = f"vllm/{names.pop(0)}"
    file = root / package / f"{module}.py"
    if not file.is_file():
        return False
    scope = _module_body(file)
    for name in names:
        found: ast.stmt | None = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name == name:
                    found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found = node
        if found is None:
            return False
        scope = found.body if isinstance(found, ast.ClassDef) else []
    return True


def cited_rules(file: Path) -> dict[str, set[str]]:
    """Each module-level test function of a file -> the rule and decision ids its docstring names."""
    cited = {}
    for node in _module_body(file):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            doc = ast.get_docstring(node) or ""
            cited[node.name] = set(re.findall(rf"\b({RULE_ID}|{DECISION_ID})\b", doc))
    return cited


@pytest.fixture(scope="module")
def spec_ids() -> list[str]:
    assert SPEC.is_file(), f"SPEC not found at {SPEC}"
    ids = spec_rule_ids(SPEC.read_text())
    # A parser that finds nothing would make every check below pass vacuously.
    assert len(ids) >= 40 and ids[0] == "STEP-1", f"SPEC parsed to {ids[:5]}..."
    return ids


@pytest.fixture(scope="module")
def rules_text() -> str:
    return RULES.read_text()


@pytest.fixture(scope="module")
def rows(rules_text: str) -> dict[str, list[str]]:
    return map_rows(rules_text)


def test_every_spec_rule_has_a_row(spec_ids: list[str], rows: dict[str, list[str]]) -> None:
    """Every rule id SPEC defines has a row in the rule map."""
    missing = [rule for rule in spec_ids if rule not in rows]
    assert not missing, f"rules missing from spec/RULES.md: {missing}"


def test_no_row_names_a_rule_spec_does_not_have(
    spec_ids: list[str], rows: dict[str, list[str]]
) -> None:
    """The rule map has no row for a rule id that SPEC does not define."""
    stale = [r for r in rows if re.fullmatch(RULE_ID, r) and r not in spec_ids]
    assert not stale, f"rows for unknown rules in spec/RULES.md: {stale}"


def test_every_rule_row_names_an_owner_a_place_and_tests(rows: dict[str, list[str]]) -> None:
    """Each rule row has a known owner, a place, and a real test unless it is marked untested."""
    untested = set()
    for rule, cells in rows.items():
        if not re.fullmatch(RULE_ID, rule):
            continue
        assert len(cells) == 3, f"{rule}: expected owner | enforced in | tests, got {cells}"
        owner, where, tests = cells
        assert owner in OWNERS, f"{rule}: owner {owner!r} is not one of {sorted(OWNERS)}"
        assert where, f"{rule}: no place where it is enforced"
        if owner == "both":
            assert "core:" in where and "adapter:" in where, f"{rule}: say where each part is"
        if UNTESTED_MARK in tests:
            untested.add(rule)
        else:
            assert checked_tests(tests), f"{rule}: no test"
    assert untested == UNTESTED, (
        f"rules marked {UNTESTED_MARK} in spec/RULES.md: {sorted(untested)}; "
        f"UNTESTED here says {sorted(UNTESTED)}: a rule that got a test loses the mark in both"
    )


def test_no_adapter_placeholder_remains(rules_text: str) -> None:
    """No row of the rule map still names the adapter's tests by a placeholder."""
    assert PLACEHOLDER not in rules_text
    assert "tests/test_adapter_*" not in rules_text


def test_every_named_test_exists(rows: dict[str, list[str]]) -> None:
    """Every test the rule map names exists as a test in the named file."""
    refs = [ref for cells in rows.values() for ref in checked_tests(cells[-1])]
    assert len(refs) >= 150, "the rule map names suspiciously few tests"
    assert {path for path, _ in refs} >= {"tests/test_core_rules.py", *ADAPTER_TEST_FILES}
    missing = missing_tests(refs, ROOT)
    assert not missing, f"spec/RULES.md names tests that do not exist: {missing}"


def test_gpu_tests_and_only_they_are_marked(rows: dict[str, list[str]]) -> None:
    """A named test is marked (GPU) exactly when it carries the ``gpu`` mark."""
    refs = [ref for cells in rows.values() for ref in named_tests(cells[-1])]
    assert any(marked for *_, marked in refs), "no GPU test is named"
    wrong = wrong_gpu_marks(refs, ROOT)
    assert not wrong, f"spec/RULES.md: {wrong}"


def test_every_place_named_exists(rows: dict[str, list[str]]) -> None:
    """Every function, class or table an "enforced in" cell names exists in its module."""
    refs: list[tuple[str, str, str]] = []
    for ident, cells in rows.items():
        owner, where = (cells[0], cells[1]) if len(cells) == 3 else ("core", cells[0])
        refs.extend((ident, package, name) for package, name in code_refs(owner, where))
    assert len(refs) >= 150, "the rule map names suspiciously few places"
    assert {package for _, package, _ in refs} == set(PACKAGES.values())
    missing = [f"{i}: {p}.{n}" for i, p, n in refs if not resolves(p, n, ROOT)]
    assert not missing, f"spec/RULES.md names code that does not exist: {missing}"


def test_every_core_rule_test_is_in_the_map(rows: dict[str, list[str]]) -> None:
    """Every test in tests/test_core_rules.py is named by at least one row of the map."""
    source = (ROOT / "tests" / "test_core_rules.py").read_text()
    defined = set(re.findall(r"^def (test_\w+)\(", source, re.MULTILINE))
    named = {name for cells in rows.values() for _, name in checked_tests(cells[-1])}
    unmapped = sorted(defined - named)
    assert not unmapped, f"core rule tests not named in spec/RULES.md: {unmapped}"


@pytest.mark.parametrize("path", ADAPTER_TEST_FILES)
def test_every_adapter_test_is_in_the_rows_it_cites(path: str, rows: dict[str, list[str]]) -> None:
    """An adapter test whose docstring names rule ids is named in each of those rows."""
    file = ROOT / path
    if not file.is_file():
        pytest.skip(f"{path} does not exist")
    missing = [
        f"{name} in {ident}"
        for name, ids in cited_rules(file).items()
        for ident in sorted(ids)
        if ident not in rows or (path, name) not in checked_tests(rows[ident][-1])
    ]
    assert not missing, f"spec/RULES.md does not name these {path} tests: {missing}"


def test_the_checks_catch_a_missing_rule_and_a_missing_test(tmp_path: Path) -> None:
    """The checks report a missing row, test or place, a wrong GPU mark and a docstring's rules."""
    spec = "- STEP-1 One.\n- STEP-2 Two.\n  - not a rule: STEP-9 in prose.\n"
    assert spec_rule_ids(spec) == ["STEP-1", "STEP-2"]
    table = (
        "| STEP-1 | core | `_m.f`, `_m.C.g` | `tests/test_x.py::test_here[inline]`"
        "<br>`tests/test_x.py::test_gone` |\n"
        "| PAGE-6 | omni_cache_cuda | `_a.C.gone` | `tests/test_x.py::test_here` (GPU)"
        "<br>`tests/test_x.py::TestMachine` |\n"
        "| HIT-3 | both | core: `_m.f`; adapter: `_a.f` | `tests/test_x.py::test_gpu` |\n"
    )
    rows = map_rows(table)
    assert sorted(rows) == ["HIT-3", "PAGE-6", "STEP-1"]
    assert [r for r in spec_rule_ids(spec) if r not in rows] == ["STEP-2"]
    with pytest.raises(AssertionError, match="two rows"):
        map_rows(table + table)

    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\n"
        "def test_here() -> None:\n"
        '    """Checks STEP-1 (STEP-1, D4)."""\n'
        "@pytest.mark.gpu\n"
        "def test_gpu() -> None:\n"
        "    pass\n"
        "class _Machine:\n"
        "    pass\n"
        "TestMachine = _Machine\n"
    )
    refs = checked_tests(rows["STEP-1"][-1]) + checked_tests(rows["PAGE-6"][-1])
    assert refs[0] == ("tests/test_x.py", "test_here")
    assert missing_tests(refs, tmp_path) == ["tests/test_x.py::test_gone"]
    gpu_refs = named_tests(rows["PAGE-6"][-1]) + named_tests(rows["HIT-3"][-1])
    assert wrong_gpu_marks(gpu_refs, tmp_path) == [
        "tests/test_x.py::test_here is marked (GPU)",
        "tests/test_x.py::test_gpu is not marked (GPU)",
    ]
    assert cited_rules(tmp_path / "tests" / "test_x.py")["test_here"] == {"STEP-1", "D4"}

    for package, module in (("omni_cache_core", "_m"), ("omni_cache_cuda", "_a")):
        (tmp_path / package).mkdir()
        (tmp_path / package / f"{module}.py").write_text(
            "def f() -> None:\n    pass\nclass C:\n    def g(self) -> None:\n        pass\n"
        )
    places = [
        (package, name)
        for ident in ("STEP-1", "PAGE-6", "HIT-3")
        for package, name in code_refs(rows[ident][0], rows[ident][1])
    ]
    assert places == [
        ("omni_cache_core", "_m.f"),
        ("omni_cache_core", "_m.C.g"),
        ("omni_cache_cuda", "_a.C.gone"),
        ("omni_cache_core", "_m.f"),
        ("omni_cache_cuda", "_a.f"),
    ]
    assert [name for package, name in places if not resolves(package, name, tmp_path)] == [
        "_a.C.gone"
    ]
    assert not resolves("omni_cache_core", "_m.g", tmp_path)  # a method is not module-level
