"""Every recipe in the docs runs as written (issue 31, part 5).

Each fenced ```` ```python ```` block of README.md and docs/*.md is one test case: its
text, as it stands in the Markdown, is written to a file in a fresh directory and run
there with this interpreter (``sys.executable``, as a new process would run it:
forked.run_python), ``PYTHONPATH`` the repository root,
``CUDA_VISIBLE_DEVICES=""`` (so that the CPU runs it, as a machine without a GPU
would), and a time limit of ``TIMEOUT`` seconds. It must exit with status 0. The
recipes are small (tiny models, a few steps) and pick the GPU when there is one and
the CPU otherwise, so they run here. Other blocks (``sh``, ``bash``, plain) are not
run.

**Fragments.** A block that is not a complete program says so in its first line, as
the reader sees it::

    # fragment: <why it does not run alone>

and is listed in ``FRAGMENTS`` below, by its case id, with the same reason; its case
is reported as skipped with that reason. A block marked in the Markdown but not
listed here, or listed but no longer marked (or gone), fails
``test_the_fragments_are_marked_and_listed``: nothing is skipped silently.

**Case ids**: ``<file>-<n>-<heading>``: the Markdown file's name (``README.md``,
``mixed-precision.md``, ...), the block's number among that file's python blocks
(from 1), and the slug of the heading it sits under; e.g.
``mixed-precision.md-2-leaner-state-master-and-state_dtype``.
"""

import ast
import os
import re
import subprocess
from pathlib import Path
from typing import List, NamedTuple

import pytest
from forked import run_python
from helpers import missing_modules

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120  # seconds, per recipe
FRAGMENT = re.compile(r"^#\s*fragment:\s*(.+?)\s*$")

# The blocks that are not complete programs, by case id, with the reason their first
# line gives.
FRAGMENTS = {
    "integrations.md-3-lightning":
        'a LightningModule\'s method, under MixedPrecision("16-mixed", "cuda", '
        'scaler=mixedprec.GradScaler("cuda"))',
    "lean-precision.md-1-through-amp":
        "the amp.initialize call of a script, with its model",
    "migrating-from-apex.md-2-amp_c-and-multi_tensor_applier":
        "a legacy script's lines, under the apex alias; noop_flag, src, dst, scale are its own",
    "migrating-from-apex.md-3-checkpoints":
        "the checkpoint lines of an amp script (its model and optimizer)",
    "mixed-precision.md-8-a-whole-step-in-a-cuda-graph":
        "needs a CUDA GPU; step, optimizer, x, y and loader as described below",
    "mixed-precision.md-10-amp-apexs-opt-levels":
        "the last lines of the loop above, with clipping",
    "schedules.md-2-the-overflow-report":
        "an interactive session's output after a run of 1000 steps",
}


class Block(NamedTuple):
    file: str  # from the repository root
    line: int  # of the opening fence, from 1
    id: str
    code: str

    @property
    def fragment(self) -> str:
        """The reason on the block's ``# fragment:`` first line, or ''."""
        first = self.code.split("\n", 1)[0]
        m = FRAGMENT.match(first.strip())
        return m.group(1) if m else ""


def markdown_files() -> List[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "").lower())
    return re.sub(r"\s+", "-", text.strip())[:48].strip("-") or "top"


def python_blocks(path: Path) -> List[Block]:
    """The ```python fenced blocks of one Markdown file, each with the fence's
    indentation taken off its lines (as Markdown renders it)."""
    name = path.relative_to(REPO).as_posix()
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks, heading, i = [], "", 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)", lines[i])
        if fence is None:
            m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", lines[i])
            if m:
                heading = m.group(1)
            i += 1
            continue
        indent, marker, lang = len(fence.group(1)), fence.group(2), fence.group(3).lower()
        start, i = i, i + 1
        body = []
        while i < len(lines) and not re.match(
                rf"^\s*{re.escape(marker[0])}{{{len(marker)},}}\s*$", lines[i]):
            line = lines[i]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))):])
            i += 1
        i += 1  # the closing fence
        if lang == "python":
            n = len(blocks) + 1
            blocks.append(Block(name, start + 1, f"{path.name}-{n}-{slug(heading)}",
                                "\n".join(body) + "\n"))
    return blocks


def all_blocks() -> List[Block]:
    return [b for path in markdown_files() for b in python_blocks(path)]


BLOCKS = all_blocks()


def missing_packages(code: str) -> List[str]:
    """The top-level packages the block imports that this interpreter cannot import
    (an integration's framework, which the Makefile's venv installs as a test
    dependency). Such a recipe is skipped, as tests/python/integrations/ are, naming
    the package: the recipe is still run wherever the package is there."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []  # (the run reports it)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return sorted(missing_modules(*names))


def recipe_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    env["CUDA_VISIBLE_DEVICES"] = ""
    # (OMP_NUM_THREADS: run_python's, the worker's share of the cores)
    # nothing is downloaded: the recipes build their models from configs
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               TOKENIZERS_PARALLELISM="false")
    return env


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_recipe_runs_as_written(block, tmp_path):
    if block.id in FRAGMENTS:
        pytest.skip(f"{block.file}:{block.line}: fragment: {FRAGMENTS[block.id]}")
    missing = missing_packages(block.code)
    if missing:
        pytest.skip(f"{block.file}:{block.line}: needs {', '.join(missing)} (not installed)")
    script = tmp_path / "recipe.py"
    script.write_text(block.code, encoding="utf-8")
    try:
        done = run_python([script], cwd=tmp_path, env=recipe_env(), timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
            else (e.stdout or "")
        pytest.fail(f"{block.file}:{block.line} ({block.id}) ran past {TIMEOUT} s; "
                    f"its output:\n{out[-3000:]}")
    assert done.returncode == 0, (
        f"{block.file}:{block.line} ({block.id}) exited with {done.returncode}:\n"
        f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-6000:]}")


def test_a_recipe_is_skipped_only_for_a_package_not_installed():
    """missing_packages names what is absent, and nothing that is here (torch,
    mixedprec, the standard library): a recipe is never skipped for those."""
    code = ("import os, torch\nimport mixedprec.optim as mo\nfrom torch import nn\n"
            "import no_such_package_here.sub\nfrom no_such_other import x\nfrom . import y\n")
    assert missing_packages(code) == ["no_such_other", "no_such_package_here"]
    frameworks = ("lightning", "transformers", "accelerate")
    assert not [b.id for b in BLOCKS if b.id not in FRAGMENTS and missing_packages(b.code)
                and not any(f in b.code for f in frameworks)]


def test_the_fragments_are_marked_and_listed():
    """FRAGMENTS lists exactly the blocks whose first line says ``# fragment: <why>``,
    with the reason the Markdown gives."""
    marked = {b.id: b.fragment for b in BLOCKS if b.fragment}
    where = {b.id: f"{b.file}:{b.line}" for b in BLOCKS}
    unlisted = [f"{where[i]} ({i}): {r}" for i, r in marked.items() if i not in FRAGMENTS]
    unmarked = [f"{where.get(i, 'no such block')} ({i})" for i in FRAGMENTS if i not in marked]
    differ = [f"{where[i]} ({i}): the doc says {marked[i]!r}, FRAGMENTS {FRAGMENTS[i]!r}"
              for i in FRAGMENTS if i in marked and marked[i] != FRAGMENTS[i]]
    assert not unlisted, "fragments marked in the docs but not in FRAGMENTS:\n" + \
        "\n".join(unlisted)
    assert not unmarked, "FRAGMENTS entries without a '# fragment:' block:\n" + \
        "\n".join(unmarked)
    assert not differ, "\n".join(differ)


def test_python_blocks_start_at_the_margin():
    """A python block indented in the Markdown (inside a list item) pastes with its
    indentation: an IndentationError. Every python fence starts at column 0."""
    indented = []
    for path in markdown_files():
        for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
            if re.match(r"^\s+(`{3,}|~{3,})\s*python\b", line):
                indented.append(f"{path.relative_to(REPO).as_posix()}:{n}")
    assert not indented, "indented python blocks: " + ", ".join(indented)


def test_the_blocks_are_found():
    ids = [b.id for b in BLOCKS]
    assert len(ids) == len(set(ids)), "two blocks with one id"
    files = {b.file for b in BLOCKS}
    for name in ("README.md", "docs/mixed-precision.md", "docs/distributed.md",
                 "docs/integrations.md"):
        assert name in files
