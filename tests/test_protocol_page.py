"""The protocol page (verl_ckpt/protocol/__init__.py) is a contract, checked here so that a
change elsewhere breaks a test instead of leaving the page silently stale:

- the fault phases named in its table, in the docs' fault-injection section and in `Phase`
  (protocol/phases.py, the only list) are the same;
- every `module.function` it names exists (names relative to `verl_ckpt.`);
- the protocol step numbers (and names) that README.md and docs/ use are the page's.

No Ray, no files written: it reads the page and the Markdown files, and imports modules.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import verl_ckpt.protocol
from verl_ckpt.protocol.phases import Phase

REPO = Path(__file__).resolve().parent.parent
PAGE = verl_ckpt.protocol.__doc__ or ""
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _tables(text: str) -> list[list[list[str]]]:
    """Every `step | ...` table of the page: rows of cells; a row whose first cell is empty
    continues the row above (its cells joined to the row's)."""
    tables: list[list[list[str]]] = []
    rows: list[list[str]] | None = None
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) > 1 and cells[0] == "step":
            rows = [cells]
            tables.append(rows)
        elif rows is not None and len(cells) > 1:
            if cells[0]:
                rows.append(cells)
            else:
                rows[-1] = [
                    f"{old} {new}".strip() for old, new in zip(rows[-1], cells, strict=True)
                ]
        else:
            rows = None
    return tables


def _table(column: str) -> dict[str, dict[str, str]]:
    """The page's table with this column: step -> {column name: cell}."""
    for rows in _tables(PAGE):
        header = rows[0]
        if column in header:
            return {row[0]: dict(zip(header, row, strict=True)) for row in rows[1:]}
    raise AssertionError(f"the protocol page has no table with a {column!r} column")


def _steps() -> dict[str, str]:
    """Step id -> step name, from the page's first table."""
    return {step: row["name"] for step, row in _table("phase").items()}


def test_page_tables_list_the_same_steps_in_execution_order() -> None:
    steps = list(_steps())
    assert steps[:10] == ["0", "0'", "1", "2", "3", "4", "5", "6", "7", "E"], steps
    assert set(steps[10:]) == {"8", "9", "10", "11", "S"}, steps
    assert list(_table("function")) == steps
    assert list(_table("durable once done")) == steps


def test_page_phases_are_Phase_values() -> None:
    """(a) The page's fault phases, its table's and those it names outside a save, are
    exactly `Phase`'s values."""
    in_table = {row["phase"] for row in _table("phase").values()} - {"-"}
    outside = set(re.findall(r"Phase `(\w+)`", PAGE))
    assert in_table <= {phase.value for phase in Phase}, in_table
    assert in_table | outside == {phase.value for phase in Phase}


def _fault_section_phases() -> tuple[Path, set[str]]:
    """The phases listed by the fault-injection section of README.md or docs/."""
    for path in DOCS:
        text = path.read_text()
        section = re.search(
            r"^#+ [^\n]*[Ff]ault injection[^\n]*$(.*?)(?=^#+ |\Z)", text, re.M | re.S
        )
        if section is None:
            continue
        listed = re.search(r"^Phases?:(.*?)(?:\n\n|^Actions?:)", section.group(1), re.M | re.S)
        assert listed is not None, f"{path}: the fault-injection section lists no 'Phases:'"
        return path, set(re.findall(r"`([a-z_]+)`", listed.group(1)))
    raise AssertionError("no fault-injection section in README.md or docs/")


def test_docs_fault_injection_section_names_every_Phase() -> None:
    """(a) The docs' fault-injection section names the same phases as `Phase`."""
    path, phases = _fault_section_phases()
    assert phases == {phase.value for phase in Phase}, f"{path}: {sorted(phases)}"


def _resolve(name: str) -> object:
    """`module.function` or `module.Class.method`, relative to `verl_ckpt.`."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            target = importlib.import_module("verl_ckpt." + ".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(f"no module of verl_ckpt in {name!r}")


def _named_functions() -> list[tuple[str, str]]:
    return [
        (step, name.strip())
        for step, row in _table("function").items()
        for name in row["function"].split(",")
        if name.strip()
    ]


@pytest.mark.parametrize("step,name", _named_functions())
def test_page_functions_exist(step: str, name: str) -> None:
    """(b) Every function the page names is importable: a rename breaks this test."""
    try:
        target = _resolve(name)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"protocol step {step} names {name}, which does not exist: {exc}")
    assert callable(target), f"protocol step {step}: {name} is not a function"
    # Named where it is defined, not where it is imported: the page leads to the code.
    module = "verl_ckpt." + name.rsplit(".", 1)[0]
    defined_in = getattr(target, "__module__", None)
    assert defined_in is None or module.startswith(defined_in), (
        f"protocol step {step} names {name}, which is defined in {defined_in}"
    )


_STEP_ID = r"(?:\d+'?|[ES]\b)"
_REFERENCE = re.compile(
    rf"protocol\s+steps?\s+({_STEP_ID}(?:\s*(?:-|to|and|,)\s*{_STEP_ID})*)(?:\s+\(([^)]*)\))?"
)


def _references() -> list[tuple[str, str, str | None]]:
    """(file, step id, name given in parentheses or None) for every 'protocol step ...'."""
    found = []
    for path in DOCS:
        text = re.sub(r"\s+", " ", path.read_text())
        for match in _REFERENCE.finditer(text):
            ids = re.findall(_STEP_ID, match.group(1))
            name = match.group(2) if len(ids) == 1 else None
            found.extend((path.name, step, name) for step in ids)
    return found


def test_docs_step_numbers_are_the_page_steps() -> None:
    """(c) Every protocol step README.md and docs/ refer to is one of the page's, and
    where a reference names it ("protocol step 5 (commit record)"), the name is the page's."""
    steps = _steps()
    references = _references()
    assert references, "README.md and docs/ refer to no protocol step"
    wrong = [(path, step) for path, step, _ in references if step not in steps]
    assert not wrong, f"steps the protocol page does not have: {wrong}"
    misnamed = [
        (path, step, name)
        for path, step, name in references
        if name is not None and not name.startswith(steps[step])
    ]
    assert not misnamed, f"named otherwise than on the protocol page ({steps}): {misnamed}"
