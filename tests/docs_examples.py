"""The documentation's examples as the suite runs them (tests/test_docs_examples.py).

What a Markdown page may hold, and what becomes of it:

- ```` ```bash ```` runs as one script in the page's bash session (shell variables, the
  working directory and background jobs carry to the next block of the page, as for a
  reader); a failing command fails the block, as `set -e` would (write `cmd || echo "exit
  status $?"` to show a refusal). `# -> TEXT` comments are output the block must print.
- ```` ```console ```` is a transcript: each `$ command` runs in the same session, the lines
  after it are its output. A command must exit 0 unless the next one is `echo $?`.
- ```` ```python ```` runs as a script of its own with the project's interpreter;
  `# -> TEXT` comments are output it must print.
- An untagged block right after a bash or python block (blank lines between at most) is the
  output that block must print.
- `<!-- docs-test: skip (why) -->` right before a block: not run, counted and reported.
  `<!-- docs-test: fragment (why) -->` before a python block that cannot run alone (names a
  trainer defines): compiled, its imports run, and every attribute it uses of an imported
  name (or of `x = Imported(...)`) must exist.

Expected output is matched leniently: each expected line must be found, in order, in a line
of the output (a line may carry a log prefix); `...` stands for any text; runs of blanks
match any blanks; a number with a unit of time or size (`0.031 s`, `1m`, `931.0 KiB`,
`0.96 MB`, `81383 bytes`, `0.24 GB/s`) and a `YYYYmmddTHHMMSS` stamp match any such value.
Counts, steps and exit statuses are compared as written.

A runner of our own, not Sybil or pytest-codeblocks: pytest-codeblocks runs each block in a
shell of its own (no state between the blocks of a page), compares stdout exactly, and knows
no console transcripts; Sybil would need custom parsers and evaluators for all three kinds
(a bash session per page, transcripts, lenient output) plus collection hooks in conftest.py,
and gives one test per block, which pytest-xdist may spread over workers although each block
needs the state of the ones before it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import queue
import re
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "Block",
    "BlockFailure",
    "Session",
    "check_output",
    "check_fragment",
    "document_order",
    "parse_blocks",
]

RUNNABLE = {"bash", "console", "python"}
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(skip|fragment)\s*\((.+)\)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
# A value that varies from run to run: a time, a duration, a size, a rate.
UNITS = r"(?:GB/s|MB/s|KiB|MiB|GiB|KB|MB|GB|bytes|ms|B|s|m|h)"
VARYING = re.compile(rf"\d+(?:\.\d+)?\s*{UNITS}(?![\w/])|\d{{8}}T\d{{6}}")
DONE = "__DOCS_TEST_DONE__"


class BlockFailure(AssertionError):
    """A block that failed: its place in the page, and why (with its output's tail)."""


@dataclass
class Block:
    """One fenced block of a page: where, its language, its text, its mark (`skip`,
    `fragment` or None) and why, and the output shown right after it."""

    page: str
    line: int
    lang: str
    text: str
    mark: str | None = None
    reason: str = ""
    shown_output: str | None = None
    where: str = field(init=False)

    def __post_init__(self) -> None:
        self.where = f"{self.page}:{self.line}"


def document_order(repo: Path) -> list[Path]:
    """README.md, then the pages of docs/ in the order of the README's list of them (its
    section "Documentation"), then any other page of docs/ the README links."""
    readme = repo / "README.md"
    text = readme.read_text()
    listed = text[text.index("\n## Documentation") :] + text
    linked = re.findall(r"\]\((docs/[\w.-]+\.md)", listed)
    pages = [readme]
    for name in dict.fromkeys(linked):
        pages.append(repo / name)
    return pages


def parse_blocks(path: Path, page: str) -> list[Block]:
    """The fenced blocks of a Markdown page in reading order (runnable ones, and untagged
    ones as the output of the runnable block right before them)."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    mark: tuple[str, str] | None = None
    after_runnable = False  # only blank lines since the last runnable block closed
    i = 0
    while i < len(lines):
        line = lines[i]
        marked = MARKER.match(line)
        opened = FENCE.match(line)
        if marked:
            mark = (marked.group(1), marked.group(2))
        elif opened:
            indent, lang = opened.group(1), opened.group(2)
            end = i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            text = "\n".join(ln.removeprefix(indent) for ln in lines[i + 1 : end]) + "\n"
            if lang in ("sh", "shell"):
                lang = "bash"
            if lang in RUNNABLE:
                kind, reason = mark or (None, "")
                blocks.append(Block(page, i + 1, lang, text, kind, reason))
            elif lang == "" and after_runnable and mark is None:
                blocks[-1].shown_output = text
            elif mark is not None:
                raise ValueError(f"{page}:{i + 1}: docs-test mark before a {lang!r} block")
            after_runnable = lang in RUNNABLE
            mark = None
            i = end
        elif line.strip():
            if mark is not None:
                raise ValueError(f"{page}:{i + 1}: docs-test mark not right before a block")
            after_runnable = False
        i += 1
    return blocks


# ---- expected output ------------------------------------------------------------------------


def _line_pattern(expected: str) -> re.Pattern:
    parts = []
    for k, literal in enumerate(expected.strip().split("...")):
        if k:
            parts.append(".*")
        pos = 0
        for m in VARYING.finditer(literal):
            parts.append(_literal(literal[pos : m.start()]))
            parts.append(r"\d{8}T\d{6}" if "T" in m.group() else rf"\d+(?:\.\d+)?\s*{UNITS}")
            pos = m.end()
        parts.append(_literal(literal[pos:]))
    return re.compile("".join(parts))


def _literal(text: str) -> str:
    """Blanks inside match any blanks; blanks next to a `...` or a varying value, any or none."""
    core = r"\s+".join(re.escape(word) for word in text.split())
    if not core:
        return r"\s*"
    return (r"\s*" if text[0].isspace() else "") + core + (r"\s*" if text[-1].isspace() else "")


def check_output(expected: str, output: str) -> str | None:
    """None when every expected line is found in order in `output`, else why not."""
    lines = output.splitlines()
    at = 0
    for want in expected.splitlines():
        if not want.strip() or want.strip() == "...":
            continue
        pattern = _line_pattern(want)
        while at < len(lines) and not pattern.search(lines[at]):
            at += 1
        if at == len(lines):
            return f"expected output line not found (in order): {want.strip()!r}"
        at += 1
    return None


def arrows(text: str) -> str:
    """The expected output a block gives in `# -> TEXT` comments, one line each."""
    return "\n".join(m.group(1) for m in re.finditer(r"#\s*->\s*(.*)$", text, re.M))


# ---- the page's bash session ----------------------------------------------------------------


class Session:
    """One bash process per page, fed one command at a time; each command's output goes to
    a file of its own, and its exit status comes back on bash's stdout."""

    def __init__(self, cwd: Path, scratch: Path, env: dict[str, str]) -> None:
        self._scratch = scratch  # the session's own (its scripts and their output)
        scratch.mkdir(parents=True, exist_ok=True)
        self._count = 0
        self._proc = subprocess.Popen(
            ["bash", "--norc", "--noprofile"],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its background jobs are killed with it, by group
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._send("__rc=0")

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _send(self, text: str) -> None:
        self._proc.stdin.write(text + "\n")
        self._proc.stdin.flush()

    def run(self, script: str, timeout_s: float, errexit: bool) -> tuple[int, str]:
        """Source `script` in the session (`errexit`: a failing command ends it, as
        `set -e` would); its exit status and output. `$?` is the previous command's."""
        self._count += 1
        path = self._scratch / f"cmd_{self._count}.sh"
        out = self._scratch / f"out_{self._count}.txt"
        # The trap must be set inside the sourced file for `return` to end that file only.
        path.write_text(("trap 'return $?' ERR\n" if errexit else "") + script)
        self._send(
            f"(exit $__rc); source {path} > {out} 2>&1 < /dev/null; __rc=$?; trap - ERR; "
            f"echo {DONE} $__rc"
        )
        try:
            while True:
                line = self._lines.get(timeout=timeout_s)
                if line is None:
                    return -1, _read(out) + "\n[the page's bash session ended]"
                if line.startswith(DONE):
                    return int(line.split()[1]), _read(out)
        except queue.Empty:
            self.close()
            return -1, _read(out) + f"\n[still running after {timeout_s:.0f} s: stopped]"

    def close(self) -> None:
        """Ends the session and whatever it left running in the background."""
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
                self._proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=20)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def console_commands(text: str) -> list[tuple[str, str]]:
    """A transcript's (command, shown output) pairs; a command continues over lines ending
    in a backslash."""
    pairs: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            command = [line[2:]]
            while command[-1].rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                command.append(lines[i])
            pairs.append(("\n".join(command), []))
        elif pairs:
            pairs[-1][1].append(line)
        else:
            raise ValueError(f"console block starts with output, not '$ ': {line!r}")
        i += 1
    return [(cmd, "\n".join(out)) for cmd, out in pairs]


# ---- python fragments -----------------------------------------------------------------------


def check_fragment(code: str) -> list[str]:
    """Problems of a fragment: its imports fail, or it uses an attribute that an imported
    name (or an object made by calling one) does not have."""
    tree = ast.parse(code)
    known: dict[str, object] = {}
    problems = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                known[alias.asname or alias.name] = importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    problems.append(f"{node.module} has no {alias.name}")
                    continue
                known[alias.asname or alias.name] = getattr(module, alias.name)
    # Names bound to an instance first (`x = Imported(...)`), then every attribute used.
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            made = _resolve(node.value.func, known, [])
            if isinstance(made, type):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        known[target.id] = made
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            _resolve(node, known, problems)
    return list(dict.fromkeys(problems))


def _resolve(node: ast.expr, known: dict[str, object], problems: list[str]) -> object | None:
    """The object an expression such as `a.b.c` names, when it starts at a known name."""
    if isinstance(node, ast.Name):
        return known.get(node.id)
    if isinstance(node, ast.Call):
        inner = _resolve(node.func, known, problems)
        return inner if isinstance(inner, type) else None  # a class called: its instance
    if isinstance(node, ast.Attribute):
        owner = _resolve(node.value, known, problems)
        if owner is None:
            return None
        if not _has(owner, node.attr):
            problems.append(f"{getattr(owner, '__name__', owner)} has no attribute {node.attr}")
            return None
        return getattr(owner, node.attr, None)
    return None


def _has(owner: object, attr: str) -> bool:
    """`owner` has `attr`; for a class, also an attribute its instances get (a field, or
    `self.attr = ...` in its code)."""
    if hasattr(owner, attr):
        return True
    if not isinstance(owner, type):
        return False
    for cls in owner.__mro__:
        if attr in getattr(cls, "__annotations__", {}):
            return True
        try:
            if re.search(rf"self\.{attr}\s*[:=]", inspect.getsource(cls)):
                return True
        except (OSError, TypeError):
            continue
    return False
