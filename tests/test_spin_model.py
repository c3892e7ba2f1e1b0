"""The SPIN model in spec/: its checks pass, and its traces use the documented vocabulary.

`spec/run_checks.sh` runs the exhaustive safety search, the two liveness claims, the
reachability probes (each without preemption and with it, at smaller bounds) and every known-bad
variant; the tests here run it and read its verdict.
The trace tests run random simulations and check every line against the "Trace vocabulary"
table of `spec/MODEL.md`, so the table is the single description of the trace format.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "spec" / "omni_cache.pml"
MODEL_DOC = ROOT / "spec" / "MODEL.md"
RUN_CHECKS = ROOT / "spec" / "run_checks.sh"

needs_spin = pytest.mark.skipif(
    shutil.which("spin") is None, reason="needs spin on PATH (CI installs it: apt-get install spin)"
)
needs_spin_and_gcc = pytest.mark.skipif(
    shutil.which("spin") is None or shutil.which("gcc") is None,
    reason="needs spin and gcc on PATH (CI installs spin: apt-get install spin)",
)

#: One action line: a name, ``field=value`` pairs, and an optional outcome after ``->``.
ACT_LINE = re.compile(
    r"^ACT (?P<name>[a-z_]+)(?P<fields>(?: [a-z0-9_]+=-?[a-z0-9_]+)*)(?: -> (?P<outcome>.+))?$"
)
#: What SPIN itself prints around a simulation's actions.
SPIN_OWN_LINE = re.compile(r"^(ltl [a-z_]+: .*|\d+ processes created)$")
#: Field values that are words, not numbers.
WORD_VALUES = {"reason": {"hit4", "hit6", "failed"}}
#: Actions every batch of simulations below must show, so the vocabulary check is not vacuous.
COMMON_ACTIONS = {
    "finish", "start", "sched", "new_step", "barrier", "budget", "save", "materialize",
    "read", "own", "consumed", "copy", "pool_write", "shutdown", "preempt", "resume", "deliver",
}  # fmt: skip


def documented_vocabulary() -> dict[str, tuple[list[str], list[re.Pattern[str]]]]:
    """Parse the action table of spec/MODEL.md: fields and outcome patterns per action."""
    section = MODEL_DOC.read_text().split("## Trace vocabulary", 1)[1].split("\n## ", 1)[0]
    vocabulary: dict[str, tuple[list[str], list[re.Pattern[str]]]] = {}
    for row in section.splitlines():
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if len(cells) != 4 or not re.fullmatch(r"`[a-z_]+`", cells[0]):
            continue
        fields = " ".join(re.findall(r"`([^`]*)`", cells[1])).split()
        outcomes = [
            re.compile(re.sub(r"<[a-z]+>", "-?[0-9]+", re.escape(text).replace(r"\<", "<")))
            for text in re.findall(r"`([^`]*)`", cells[2])
        ]
        vocabulary[cells[0].strip("`")] = (fields, outcomes)
    return vocabulary


def simulate(seed: int, *defines: str) -> list[str]:
    """Run one random simulation of the model and return its output lines, stripped."""
    with tempfile.TemporaryDirectory() as scratch:
        proc = subprocess.run(
            ["spin", f"-n{seed}", "-u100000", *defines, str(MODEL)],
            cwd=scratch,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


def check_line(line: str, vocabulary: dict[str, tuple[list[str], list[re.Pattern[str]]]]) -> str:
    """Assert that one action line follows the documented vocabulary; return its action name."""
    match = ACT_LINE.match(line)
    assert match, f"not an action line of the documented grammar: {line!r}"
    name = match["name"]
    assert name in vocabulary, f"action {name!r} is not in spec/MODEL.md: {line!r}"
    fields, outcomes = vocabulary[name]
    pairs = [item.split("=", 1) for item in match["fields"].split()]
    names = [key for key, _ in pairs]
    assert set(names) <= set(fields) and len(set(names)) == len(names), (
        f"fields {names} are not among the documented {fields}: {line!r}"
    )
    for key, value in pairs:
        if key in WORD_VALUES:
            assert value in WORD_VALUES[key], f"{key}={value} is not documented: {line!r}"
        else:
            assert re.fullmatch(r"-?[0-9]+", value), f"{key}={value} is not a number: {line!r}"
    outcome = match["outcome"]
    if outcomes:
        assert outcome is not None, f"{name} without its outcome: {line!r}"
        assert any(pattern.fullmatch(outcome) for pattern in outcomes), (
            f"outcome {outcome!r} is not documented for {name}: {line!r}"
        )
    else:
        assert outcome is None, f"{name} documents no outcome: {line!r}"
    return name


def test_the_documented_vocabulary_matches_what_the_model_prints() -> None:
    """Every action the model source prints has a row in spec/MODEL.md, and every row is printed."""
    printed = set(re.findall(r'printf\("ACT ([a-z_]+)', MODEL.read_text()))
    documented = set(documented_vocabulary())
    assert printed == documented, (
        f"printed, not documented: {printed - documented}; documented, not printed: "
        f"{documented - printed}"
    )


def test_every_known_bad_variant_is_a_check() -> None:
    """Each BUG_ flag of the model has its own check in spec/run_checks.sh and a row in MODEL.md."""
    flags = set(re.findall(r"\bBUG_[A-Z_]+\b", MODEL.read_text()))
    script = RUN_CHECKS.read_text()
    checks = {f"BUG_{name.upper()}" for name in re.findall(r'"bug_([a-z_]+)\|', script)}
    assert flags == checks, f"model flags {sorted(flags)}; run_checks.sh checks {sorted(checks)}"
    doc = MODEL_DOC.read_text()
    assert all(f"`{flag}`" in doc for flag in flags), "a variant is missing from spec/MODEL.md"


@needs_spin
def test_random_simulations_print_only_documented_actions() -> None:
    """Random simulations print only documented action lines besides SPIN's own, and end cleanly."""
    vocabulary = documented_vocabulary()
    seen: set[str] = set()
    runs = [(seed, ()) for seed in range(1, 31)] + [(seed, ("-DBUDGET=1",)) for seed in range(5)]
    for seed, defines in runs:
        lines = simulate(seed, *defines)
        assert lines[-1].endswith("processes created"), f"seed {seed}: ended with {lines[-1]!r}"
        for line in lines:
            if SPIN_OWN_LINE.match(line):
                continue
            seen.add(check_line(line, vocabulary))
    assert seen >= COMMON_ACTIONS, f"never printed: {COMMON_ACTIONS - seen}"


@needs_spin_and_gcc
def test_speculative_runs_print_only_documented_actions() -> None:
    """With -DSPEC_DRAFTS (SPEC-1..SPEC-5) every line is in the vocabulary: random simulations,
    without preemption and with it (a draft left unconfirmed by a preemption, SPEC-5), and a
    whole run through probe 35 (a catch-up read of accepted drafts, found by pan)."""
    vocabulary = documented_vocabulary()
    defines = ["-DSPEC_DRAFTS", "-DPREEMPTS=0", "-DSTARTS=2", "-DMAXSTEP=4"]
    lines = []
    for seed in range(1, 21):
        for flags in (defines, ["-DSPEC_DRAFTS", "-DSTARTS=2"]):
            run = simulate(seed, *flags)
            assert run[-1].endswith("processes created"), f"seed {seed}: ended with {run[-1]!r}"
            lines += run
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copy(MODEL, scratch)
        probe = [*defines, "-DPROBE=35"]
        for cmd in (
            ["spin", *probe, "-a", "omni_cache.pml"],
            ["gcc", "-O0", "-DSAFETY", "-DNOCLAIM", "-DCOLLAPSE", "-o", "pan", "pan.c"],
            ["./pan", "-m100000"],
        ):
            subprocess.run(cmd, cwd=scratch, capture_output=True, timeout=300, check=True)
        trail = subprocess.run(
            ["spin", *probe, "-t", "omni_cache.pml"],
            cwd=scratch, capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
    run = [line.strip() for line in trail.stdout.splitlines() if line.strip().startswith("ACT ")]
    assert any(" draft=1" in line for line in run), run
    assert any(" computed=" in line for line in run), run
    assert any(" catchup=1 " in line for line in run), run
    for line in lines + run:
        if line.startswith("ACT "):
            check_line(line, vocabulary)


def test_the_vocabulary_check_rejects_a_stray_line() -> None:
    """The line check refuses an unknown action, an undocumented field and an undocumented outcome."""
    vocabulary = documented_vocabulary()
    assert check_line("ACT save step=1 page=0 tid=1 d0=2 d1=0 -> ok", vocabulary) == "save"
    refused = "ACT materialize step=3 req=0 earlier=2 start=0 end=2 -> error=order"
    assert check_line(refused, vocabulary) == "materialize"
    for bad in (
        "ACT evict step=1",
        "ACT save step=1 slot=3 -> ok",
        "ACT save step=1 page=0 tid=1 d0=2 d1=0 -> maybe",
        "ACT read step=1 req=0 key=0 slot=1",
        "timeout",
    ):
        with pytest.raises(AssertionError):
            check_line(bad, vocabulary)


@needs_spin_and_gcc
@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("OMNI_CACHE_MODEL_CHECKED") == "1",
    reason="spec/run_checks.sh already ran in this job (.ci/run runs it before the tests)",
)
def test_run_checks_passes() -> None:
    """spec/run_checks.sh verifies the model and catches every known-bad variant."""
    proc = subprocess.run(
        ["bash", str(RUN_CHECKS)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    lines = proc.stdout.splitlines()
    assert lines and all(line.startswith("PASS ") for line in lines), report
    names = {line.split()[1] for line in lines}
    assert {
        "safety", "safety_resume", "live_pages_released", "live_writes_end",
        "live_resume_pages_released", "live_resume_writes_end", "reach", "reach_resume",
        "safety_spec", "safety_spec_resume", "reach_spec", "reach_spec_resume",
        "bug_spec_end_marks_accepted_absent",
    } <= names, report  # fmt: skip
    assert sum(name.startswith("bug_") for name in names) >= 10, report
