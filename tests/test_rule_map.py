"""The rule map (spec/RULES.md) covers every SPEC rule id and names only tests that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT.parent / "shared" / "SPEC.md"
RULES = ROOT / "spec" / "RULES.md"

RULE_ID = r"(?:STEP|PAGE|SLOT|TASK|BUDGET|HIT|OUT|FAIL|CONC|DEV)-\d+"
#: A rule is defined by a bullet that starts with its id ("- STEP-1 Every save ...").
SPEC_BULLET = re.compile(rf"^\s*[-*]\s+({RULE_ID})\b", re.MULTILINE)
#: A table row of the rule map: ``| RULE | owner | where | tests |``.
ROW = re.compile(rf"^\|\s*({RULE_ID}|D\d+|invariants)\s*\|(.*)\|\s*$", re.MULTILINE)
TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
#: Placeholders for tests the adapter will add; they are not checked yet.
ADAPTER_MARK = "(adapter tests)"
OWNERS = {"core", "omni_cache_cuda", "both"}


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


def checked_tests(tests_cell: str) -> list[tuple[str, str]]:
    """The ``(file, test name)`` pairs a tests cell names, placeholders left out."""
    refs = []
    for entry in tests_cell.split("<br>"):
        if ADAPTER_MARK in entry:
            continue
        refs.extend(TEST_REF.findall(entry))
    return refs


def missing_tests(refs: list[tuple[str, str]], root: Path) -> list[str]:
    """The references whose file or test function does not exist under `root`."""
    missing = []
    sources: dict[str, str] = {}
    for path, name in refs:
        if path not in sources:
            file = root / path
            sources[path] = file.read_text() if file.is_file() else ""
        if not re.search(rf"^(?:async )?def {name}\(", sources[path], re.MULTILINE):
            missing.append(f"{path}::{name}")
    return missing


@pytest.fixture(scope="module")
def spec_ids() -> list[str]:
    if not SPEC.is_file():
        pytest.skip(f"SPEC not found at {SPEC}: the shared folder is not next to the repository")
    ids = spec_rule_ids(SPEC.read_text())
    # A parser that finds nothing would make every check below pass vacuously.
    assert len(ids) >= 40 and ids[0] == "STEP-1", f"SPEC parsed to {ids[:5]}..."
    return ids


@pytest.fixture(scope="module")
def rows() -> dict[str, list[str]]:
    return map_rows(RULES.read_text())


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
    """Each rule row has a known owner, a place, and a test or an adapter placeholder."""
    for rule, cells in rows.items():
        if not re.fullmatch(RULE_ID, rule):
            continue
        assert len(cells) == 3, f"{rule}: expected owner | enforced in | tests, got {cells}"
        owner, where, tests = cells
        assert owner in OWNERS, f"{rule}: owner {owner!r} is not one of {sorted(OWNERS)}"
        assert where, f"{rule}: no place where it is enforced"
        assert tests, f"{rule}: no tests"
        if owner in ("core", "both"):
            assert checked_tests(tests), f"{rule}: the core's part has no test"
        else:
            assert ADAPTER_MARK in tests or checked_tests(tests), f"{rule}: no test"


def test_every_named_test_exists(rows: dict[str, list[str]]) -> None:
    """Every test the rule map names exists as a function in the named file."""
    refs = [ref for cells in rows.values() for ref in checked_tests(cells[-1])]
    assert len(refs) >= 50, "the rule map names suspiciously few tests"
    missing = missing_tests(refs, ROOT)
    assert not missing, f"spec/RULES.md names tests that do not exist: {missing}"


def test_every_core_rule_test_is_in_the_map(rows: dict[str, list[str]]) -> None:
    """Every test in tests/test_core_rules.py is named by at least one row of the map."""
    source = (ROOT / "tests" / "test_core_rules.py").read_text()
    defined = set(re.findall(r"^def (test_\w+)\(", source, re.MULTILINE))
    named = {name for cells in rows.values() for _, name in checked_tests(cells[-1])}
    unmapped = sorted(defined - named)
    assert not unmapped, f"core rule tests not named in spec/RULES.md: {unmapped}"


def test_the_checks_catch_a_missing_rule_and_a_missing_test(tmp_path: Path) -> None:
    """The parsers report a rule without a row and a test that does not exist."""
    spec = "- STEP-1 One.\n- STEP-2 Two.\n  - not a rule: STEP-9 in prose.\n"
    assert spec_rule_ids(spec) == ["STEP-1", "STEP-2"]
    table = (
        "| STEP-1 | core | `m.f` | `tests/test_x.py::test_here`<br>`tests/test_x.py::test_gone` |\n"
        "| PAGE-6 | omni_cache_cuda | `a.py` | tests/test_adapter_*.py (adapter tests) |\n"
    )
    rows = map_rows(table)
    assert sorted(rows) == ["PAGE-6", "STEP-1"]
    assert [r for r in spec_rule_ids(spec) if r not in rows] == ["STEP-2"]
    assert checked_tests(rows["PAGE-6"][-1]) == []
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_here() -> None:\n    pass\n")
    refs = checked_tests(rows["STEP-1"][-1])
    assert missing_tests(refs, tmp_path) == ["tests/test_x.py::test_gone"]
    with pytest.raises(AssertionError, match="two rows"):
        map_rows(table + table)
