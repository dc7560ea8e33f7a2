"""Every number in the README's results table stands on a committed result file.

Each row of the table under *Results at a glance* links to a section of ``docs/`` (``page.md#anchor``). That section
names one or more committed result files (``benchmarks/results/...json``, in its own text before its first
subheading), each of which exists; a file's top-level ``source`` may name the measurement it was computed from, which
joins them. Every number the row states is then found in those files:

- rounded to the digits printed (``3.99x`` is any value in [3.985, 3.995]), with its sign (``-0.9`` is not ``0.9``);
- in the unit printed: ``x`` a plain value; ``%`` and ``points`` a fraction times 100 or a value already in percent
  or points; ``GB`` / ``MB`` bytes (decimal or binary) or a value already in that unit; ``ms`` seconds times 1,000
  or milliseconds; numbers in ``[a, b]`` after a number take its unit (an interval);
- a date (``2026-12-04``) is found in a file's strings or path, and a machine the row names (Intel Xeon, AMD EPYC,
  H200) in the files' strings (``meta.device_name``);
- what the files do not hold directly is computed from them, not written here: how many items a list holds (20
  seeds), and, for a row that says "over seeds A-B", each arm's mean per-seed ratio of CPU seconds to GRPO's over
  those seeds (from the file's rows).

Names are not numbers (``SmolLM2-135M``, ``Qwen2``, ``H200``, ``fp32``, inline code), nor are the confidence levels of
intervals (``95% interval``). A file combined over seeds (rows and a ``summary``) is quoted by its summary and its
settings, never by one seed's row or a ``per_seed`` value. docs/results.md's machines are checked the same way: a
paragraph that names a result file and a machine names the one the file records, and a section names every machine
its result files record.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import statistics

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
#: A result file a section names (not one a ``git show COMMIT:path`` recalls from history).
RESULT_FILE = re.compile(r"(?<![:\w/])benchmarks/results/[\w./-]+?\.json(?![\w.])")
DATE = re.compile(r"\b(20\d\d-\d\d-\d\d)\b")
#: A number: not part of a name (no letter, digit, ``_`` or ``.`` just before it), thousands grouped or not, then
#: what follows it (a unit glued on, or a word after one space).
NUMBER = re.compile(r"(?<![\w.])([-+]?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?([A-Za-z%]*)(?:\s(ms|GB|MB|points?)\b)?")
#: The scales a printed unit may stand for: value in the file times scale = the number printed.
SCALES = {
    "": (1.0,),
    "x": (1.0,),
    "%": (100.0, 1.0),
    "points": (100.0, 1.0),
    "GB": (1e-9, 2.0**-30, 1.0),
    "MB": (1e-6, 2.0**-20, 1.0),
    "ms": (1e3, 1.0),
}
MACHINES = {"Intel Xeon": "Xeon", "AMD EPYC": "EPYC", "H200": "H200"}
CONFIDENCE_LABEL = re.compile(r"\b\d\d% (?:interval|CI)\b")


@dataclasses.dataclass(frozen=True)
class Stated:
    """A number a row states: its text, value, digits after the point and unit."""

    text: str
    value: float
    digits: int
    unit: str


def results_table(text: str) -> list[list[str]]:
    """The cells of each body row of the README's results table (the first table under *Results at a glance*)."""
    section = text.split("\n## Results at a glance", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    assert len(lines) >= 3 and re.fullmatch(r"\|( *:?-+:? *\|)+", lines[1]), lines[:2]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def section_text(page: pathlib.Path, anchor: str) -> str:
    """The text of ``page``'s section ``anchor``, from its heading to its first subheading or the next heading."""
    lines = page.read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"#+ ", line) and slug(line.lstrip("#")) == anchor]
    assert starts, f"{page.name} has no section #{anchor}"
    body = []
    for line in lines[starts[0] + 1 :]:
        if re.match(r"#+ ", line):
            break
        body.append(line)
    return "\n".join(body)


def row_links(cells: list[str]) -> list[tuple[pathlib.Path, str]]:
    """The ``(page, anchor)`` of every link of a row into docs/."""
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)#([\w-]+)\)", " | ".join(cells))
    return [(REPO / page, anchor) for page, anchor in links]


def strings(data) -> list[str]:
    if isinstance(data, dict):
        return [s for v in data.values() for s in strings(v)]
    if isinstance(data, list):
        return [s for v in data for s in strings(v)]
    return [data] if isinstance(data, str) else []


def result_files(cells: list[str]) -> list[pathlib.Path]:
    """The committed result files behind a row: those its linked sections name, and those their ``source`` names."""
    files: list[pathlib.Path] = []
    for page, anchor in row_links(cells):
        for name in RESULT_FILE.findall(section_text(page, anchor)):
            path = REPO / name
            assert path.is_file(), f"{page.name}#{anchor} names {name}, which is not committed"
            files.append(path)
    for path in list(files):
        source = json.loads(path.read_text(encoding="utf-8")).get("source", "")
        files += [REPO / name for name in RESULT_FILE.findall(str(source)) if (REPO / name).is_file()]
    return list(dict.fromkeys(files))


def plain_text(cells: list[str]) -> str:
    """The row's text without what is not a stated number: link targets, inline code, confidence levels."""
    text = " | ".join(cells)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"`[^`]*`", " ", text)
    text = CONFIDENCE_LABEL.sub(" ", text)
    return DATE.sub(" ", text)


def stated_numbers(cells: list[str]) -> list[Stated]:
    """Every number a row states, with its unit (an interval's bounds take the unit of the number before it)."""
    text = plain_text(cells)
    out: list[Stated] = []
    for m in NUMBER.finditer(text):
        sign, whole, fraction, glued, word = m.groups()
        if glued and glued not in ("x", "%", "GB", "MB", "ms", "s"):
            continue  # part of a name: 135M, 1.5B, 8K
        unit = "points" if (word or "").startswith("point") else word or glued
        unit = "" if unit == "s" else unit
        inside = text.rfind("[", 0, m.start()) > text.rfind("]", 0, m.start())
        if inside and not unit and out:
            unit = out[-1].unit  # [-2.7, +0.8] after "-0.9 points"
        value = float(sign + whole.replace(",", "") + (fraction or ""))
        out.append(Stated(m.group(0).strip(), value, len(fraction) - 1 if fraction else 0, unit))
    return out


def flat(data, path: str = "") -> list[tuple[str, float]]:
    """``(path, number)`` of every numeric leaf (not under ``per_seed``) and of the length of every list."""
    if isinstance(data, dict):
        return [x for k, v in data.items() if k != "per_seed" for x in flat(v, f"{path}.{k}")]
    if isinstance(data, list):
        return [(f"{path}#", float(len(data))), *(x for i, v in enumerate(data) for x in flat(v, f"{path}[{i}]"))]
    if isinstance(data, (int, float)) and not isinstance(data, bool) and math.isfinite(data):
        return [(path, float(data))]
    return []


def shared_settings(rows: list[dict]) -> list[float]:
    """What every row of an arm holds alike (its settings and the counts they fix), not what one seed measured."""
    arms: dict[str, list[dict]] = {}
    for row in rows:
        arms.setdefault(str(row.get("arm")), []).append(dict(flat(row)))
    out = []
    for group in (g for g in arms.values() if len(g) > 1):
        out += [v for k, v in group[0].items() if all(other.get(k) == v for other in group[1:])]
    return out


def file_values(data) -> list[float]:
    """The numbers a row may quote from a file. A file combined over seeds (rows and a ``summary``) is quoted by its
    summary, its settings (``meta`` but each unit's ``sources``, and what every row of an arm shares), never by one
    seed's row; any other file by all its numbers."""
    if isinstance(data, dict) and "summary" in data and isinstance(data.get("rows"), list):
        meta = {k: v for k, v in data.get("meta", {}).items() if k != "sources"}
        return [v for _, v in (*flat(meta), *flat(data["summary"]))] + shared_settings(data["rows"])
    return [v for _, v in flat(data)]


def seed_range_cpu_ratios(data, text: str) -> list[float]:
    """For a row that says "over seeds A-B": each arm's mean over those seeds of its CPU seconds / GRPO's."""
    rows = data.get("rows") if isinstance(data, dict) else None
    out = []
    for first, last in re.findall(r"seeds (\d+)-(\d+)", text):
        seeds = range(int(first), int(last) + 1)
        if not rows or not all(isinstance(r, dict) and {"arm", "seed", "cpu_seconds"} <= r.keys() for r in rows):
            continue
        cpu = {(r["arm"], r["seed"]): r["cpu_seconds"] for r in rows}
        for arm in {r["arm"] for r in rows}:
            if all((arm, s) in cpu and ("grpo", s) in cpu for s in seeds):
                out.append(statistics.mean(cpu[(arm, s)] / cpu[("grpo", s)] for s in seeds))
    return out


def found(stated: Stated, values: list[float]) -> bool:
    """Whether ``stated`` is one of ``values`` in its unit, rounded to its digits, with its sign."""
    if not stated.unit and not stated.digits:  # a count or a setting (16, 2,048, seeds 45-50): exactly
        return stated.value in values
    half = 0.5 * 10.0**-stated.digits
    scales = SCALES[stated.unit]
    return any(abs(v * scale - stated.value) <= half * (1 + 1e-9) + 1e-12 for v in values for scale in scales)


def unbacked(cells: list[str], files: list[pathlib.Path]) -> list[str]:
    """What a row states that its result files do not hold: numbers, dates and machines."""
    datas = [json.loads(path.read_text(encoding="utf-8")) for path in files]
    text = " | ".join(cells)
    values = [x for data in datas for x in (*file_values(data), *seed_range_cpu_ratios(data, text))]
    words = [s for data in datas for s in strings(data)] + [path.relative_to(REPO).as_posix() for path in files]
    missing = [s.text for s in stated_numbers(cells) if not found(s, values)]
    missing += [d for d in DATE.findall(re.sub(r"\]\([^)]*\)", "]", text)) if not any(d in w for w in words)]
    missing += [m for m, key in MACHINES.items() if m in text and not any(key in w for w in words)]
    return missing


README_ROWS = results_table(README.read_text(encoding="utf-8"))


def row_id(cells: list[str]) -> str:
    return re.sub(r"[^\w ,=.-]", "", cells[0])[:60]


def test_the_table_has_its_rows():
    assert len(README_ROWS) >= 8 and all(len(cells) == len(README_ROWS[0]) for cells in README_ROWS)


@pytest.mark.parametrize("cells", README_ROWS, ids=row_id)
def test_every_row_links_to_a_section_that_names_a_committed_result_file(cells):
    assert row_links(cells), f"the row links to no section of docs/: {cells[0]}"
    assert result_files(cells), f"its sections name no committed benchmarks/results/...json: {cells[0]}"


@pytest.mark.parametrize("cells", README_ROWS, ids=row_id)
def test_every_number_of_a_row_is_in_its_result_files(cells):
    files = result_files(cells)
    assert stated_numbers(cells), cells[0]
    assert not unbacked(cells, files), (unbacked(cells, files), [f.relative_to(REPO).as_posix() for f in files])


def test_the_checker_reads_numbers_as_printed():
    row = ["SmolLM2-135M on H200 (2026-12-04), fp32, `max_staleness: 1`", "-0.9 points [-2.7, +0.8], 95% interval",
           "3.99x, 55%, 2,048, ~2.3 GB, 34.7 ms, seeds 45-50"]  # fmt: skip
    got = [(s.value, s.digits, s.unit) for s in stated_numbers(row)]
    assert got == [
        (-0.9, 1, "points"), (-2.7, 1, "points"), (0.8, 1, "points"), (3.99, 2, "x"), (55.0, 0, "%"),
        (2048.0, 0, ""), (2.3, 1, "GB"), (34.7, 1, "ms"), (45.0, 0, ""), (50.0, 0, ""),
    ]  # fmt: skip
    assert found(Stated("55%", 55, 0, "%"), [0.549]) and found(Stated("2.3 GB", 2.3, 1, "GB"), [2.28e9])
    assert not found(Stated("-0.9", -0.9, 1, "points"), [0.0093]) and not found(Stated("4x", 4, 0, "x"), [3.4])


def test_a_fabricated_number_fails_the_checker():
    """The negative control: the headline row with one number changed, and a row with a number no file holds."""
    (speed,) = [cells for cells in README_ROWS if "3.99x" in " ".join(cells)]
    files = result_files(speed)
    assert not unbacked(speed, files)
    altered = [cell.replace("3.99x", "3.89x") for cell in speed]
    assert unbacked(altered, files) == ["3.89x"]
    made_up = [speed[0], speed[1], "training passes 7.31x faster, accuracy +12.5 points", speed[-1]]
    assert unbacked(made_up, files) == ["7.31x", "+12.5 points"]
    assert unbacked([*speed[:-1], speed[-1] + " on an AMD EPYC"], files) == ["AMD EPYC"]  # speedup.json: a Xeon
    # a file combined over seeds: its summary's means and intervals are strict too, not lost among the seeds' rows
    (accuracy,) = [cells for cells in README_ROWS if "46.4%" in " ".join(cells) and "0.54x" in " ".join(cells)]
    files = result_files(accuracy)
    changed = {"46.4%": "47.4%", "0.54x": "0.58x", "-0.9 points": "-1.9 points", "20 seeds": "21 seeds"}
    for real, fake in changed.items():
        assert unbacked([cell.replace(real, fake) for cell in accuracy], files) == [fake.split(" seeds")[0]], fake


def paragraphs(page: pathlib.Path) -> list[str]:
    return re.split(r"\n\s*\n", page.read_text(encoding="utf-8"))


def recorded_machines(path: pathlib.Path) -> set[str]:
    words = strings(json.loads(path.read_text(encoding="utf-8")))
    return {m for m, key in MACHINES.items() if any(key in w for w in words)}


def sections(page: pathlib.Path) -> list[tuple[str, str]]:
    """``(heading, text up to the next heading)`` of every section of ``page``."""
    parts = re.split(r"^(#+ .*)$", page.read_text(encoding="utf-8"), flags=re.M)
    return list(zip(["(top)", *parts[1::2]], parts[0::2]))


RESULTS_PAGE = REPO / "docs" / "results.md"


def test_a_paragraph_names_the_machine_its_result_file_records():
    """docs/results.md: a paragraph that names a result file and a machine names the machine the file records."""
    wrong = []
    for text in paragraphs(RESULTS_PAGE):
        named = {m for m in MACHINES if m in text}
        for name in RESULT_FILE.findall(text):
            recorded = recorded_machines(REPO / name) if (REPO / name).is_file() else set()
            if named and recorded and not recorded & named:
                wrong.append((name, sorted(recorded), sorted(named)))
    assert not wrong, wrong


def test_a_section_names_every_machine_its_result_files_record():
    """docs/results.md: a section whose result files record a machine says which (a reader compares like with like)."""
    missing = []
    for heading, text in sections(RESULTS_PAGE):
        recorded = {
            m for name in RESULT_FILE.findall(text) if (REPO / name).is_file() for m in recorded_machines(REPO / name)
        }
        missing += [(heading, m) for m in sorted(recorded) if m not in text]
    assert not missing, missing
