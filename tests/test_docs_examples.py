"""Every shell and Python example of README.md and docs/*.md runs, in the order a reader meets
them (README first, then the pages in the order of its list "Documentation"), from one clean
working directory, and prints what the page shows. How a page marks its blocks and how
output is matched: tests/docs_examples.py.

A reader's state carries over: files (checkpoint roots) from page to page, shell variables
and background jobs within a page. So the pages are one test, which runs them all in one
worker (not one test per page: pytest-xdist 3.8's `--dist loadgroup` was seen spreading the
tests of one `xdist_group` over both workers). `python` is this interpreter and `verl-ckpt`
its console script; PYTHONPATH points at this checkout, so the recipe and the command run its
code."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.docs_examples import (
    Block,
    Session,
    arrows,
    check_fragment,
    check_output,
    console_commands,
    document_order,
    parse_blocks,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGES = [p.relative_to(REPO_ROOT).as_posix() for p in document_order(REPO_ROOT)]
# One block: a recipe run takes about a minute on 2 loaded cores, the preemption block two.
BLOCK_TIMEOUT_S = 420


@dataclass
class PageResult:
    ran: int = 0
    fragments: int = 0
    skipped: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def summary(self, page: str) -> str:
        lines = [
            f"{page}: {self.ran} block(s) run, {self.fragments} fragment(s) checked, "
            f"{len(self.skipped)} skipped"
        ]
        lines += [f"  skipped {why}" for why in self.skipped]
        return "\n".join(lines)


class Reader:
    """A reader working through the pages in one directory, with the project's tools."""

    def __init__(self, base: Path) -> None:
        self.cwd = base / "reader"
        self.scratch = base / "scratch"
        bin_dir = self.scratch / "bin"
        for d in (self.cwd, bin_dir):
            d.mkdir(parents=True)
        for name, script in _commands().items():
            wrapper = bin_dir / name
            wrapper.write_text(f"#!/bin/sh\n{script}\n")
            wrapper.chmod(0o755)
        env = {
            k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("AWS_")
        }
        env["PATH"] = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env["OMP_NUM_THREADS"] = "1"
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray on 127.0.0.1 only (conftest)
        env.setdefault("RAY_worker_niceness", "0")
        self.env = env

    def run_page(self, page: str) -> PageResult:
        result = PageResult()
        session = None
        sessions = 0
        try:
            for block in parse_blocks(REPO_ROOT / page, page):
                if block.mark == "skip":
                    result.skipped.append(f"{block.where} ({block.reason})")
                    continue
                if block.mark == "fragment":
                    result.fragments += 1
                    problems = check_fragment(block.text)
                    result.failures += [f"{block.where}: fragment: {p}" for p in problems]
                    continue
                result.ran += 1
                if block.lang == "python":
                    result.failures += self._run_python(block)
                    continue
                if session is None:
                    sessions += 1
                    scratch = self.scratch / f"{page.replace('/', '_')}.{sessions}"
                    session = Session(self.cwd, scratch, self.env)
                problems = self._run_shell(session, block)
                result.failures += problems
                if any("session ended" in p or "stopped]" in p for p in problems):
                    session.close()
                    session = None
        finally:
            if session is not None:
                session.close()
        return result

    def _run_shell(self, session: Session, block: Block) -> list[str]:
        if block.lang == "bash":
            status, output = session.run(block.text, BLOCK_TIMEOUT_S, errexit=True)
            expected = arrows(block.text) + "\n" + (block.shown_output or "")
            return _judge(block.where, block.text, status, output, expected)
        problems = []
        commands = console_commands(block.text)
        for k, (command, shown) in enumerate(commands):
            status, output = session.run(command + "\n", BLOCK_TIMEOUT_S, errexit=False)
            shows_status = k + 1 < len(commands) and commands[k + 1][0].strip() == "echo $?"
            problems += _judge(block.where, command, 0 if shows_status else status, output, shown)
        return problems

    def _run_python(self, block: Block) -> list[str]:
        script = self.scratch / f"block_{block.page.replace('/', '_')}_{block.line}.py"
        script.write_text(block.text)
        try:
            done = subprocess.run(
                [sys.executable, str(script)],
                cwd=self.cwd,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=BLOCK_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return [f"{block.where}: still running after {BLOCK_TIMEOUT_S} s"]
        expected = arrows(block.text) + "\n" + (block.shown_output or "")
        output = done.stdout + done.stderr
        return _judge(block.where, block.text, done.returncode, output, expected)


def _commands() -> dict[str, str]:
    """`python` and the project's console scripts, as pyproject.toml declares them, run by
    this interpreter (an installed script may predate a move of its entry point)."""
    commands = {name: f'exec "{sys.executable}" "$@"' for name in ("python", "python3")}
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        module, func = target.split(":")
        code = f"import sys; sys.argv[0] = {name!r}; from {module} import {func} as f; exit(f())"
        commands[name] = f'exec "{sys.executable}" -c "{code}" "$@"'
    return commands


def _judge(where: str, command: str, status: int, output: str, expected: str) -> list[str]:
    why = f"exit status {status}" if status != 0 else check_output(expected, output)
    if why is None:
        return []
    head = command.strip().splitlines()[0][:120]
    return [f"{where}: {why}\n  command: {head}\n  output (end):\n{output[-3000:]}"]


# 8 recipe runs in all: 4 minutes on 2 idle cores, 7.5 to 13 minutes on 2 cores shared with
# other jobs (start-up is most of each run). Not `slow`: the README's own examples are checked
# by every run of the suite.
@pytest.mark.timeout(1800)
def test_documented_examples_run_as_written_in_reading_order(tmp_path):
    reader = Reader(tmp_path)
    failures = []
    for page in PAGES:
        result = reader.run_page(page)
        print(result.summary(page))
        failures += result.failures
    assert not failures, "\n\n".join(failures)


def test_every_page_of_docs_is_linked_from_the_readme_so_its_examples_run():
    pages = {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "docs").glob("*.md")}
    assert pages <= set(PAGES), f"not linked from README.md: {sorted(pages - set(PAGES))}"


def test_expected_output_matching_ignores_times_and_sizes_only():
    shown = "step 40 committed under /.../ppo_toy: 15 files, 0.96 MB\nOK step 4: 0.004 s"
    ran = "[log] step 40 committed under /tmp/x/ppo_toy: 15 files, 1.20 MB; tracker\nOK step 4: 2 s"
    assert check_output(shown, ran) is None
    assert check_output(shown.replace("15 files", "13 files"), ran) is not None
    assert check_output("step 4\nstep 40", "step 40\nstep 4") is not None  # order counts


def test_blocks_marks_and_shown_output_are_parsed(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "<!-- docs-test: skip (makes a venv) -->\n```bash\npip install x\n```\n\n"
        "```bash\necho hi\n```\n\n```\nhi\n```\n\ntext\n\n```\nnot output\n```\n"
        "```console\n$ echo a \\\n  b\na b\n$ echo $?\n0\n```\n"
    )
    skip, run, console = parse_blocks(page, "p.md")
    assert (skip.mark, skip.reason) == ("skip", "makes a venv")
    assert run.shown_output == "hi\n"
    assert console_commands(console.text) == [("echo a \\\n  b", "a b"), ("echo $?", "0")]


def test_a_fragment_using_an_attribute_the_api_lacks_is_caught():
    code = "from verl_ckpt import CheckpointManager\nm = CheckpointManager(c)\nm.fence()\nm.no()\n"
    assert check_fragment(code) == ["CheckpointManager has no attribute no"]
