"""Every link and every cited repository path in the committed Markdown files exists
(issue 31, part 5: docs that lead with today's API, and cite only what is there).

The files: every ``*.md`` of the repository (``git ls-files '*.md'``: README.md, docs/,
bench/, bench/results/, csrc/, docker/, examples/; and new ones not yet committed, but
never what .gitignore ignores: .venv, build/), read from the working tree. "In the
repository" below means the same: a file or directory git tracks or would track. Fenced
code blocks (``` and ~~~) are skipped whole: their text is commands and output, not
prose.

What is checked, each problem reported as ``file:line: what``:

1. **Links.** Every inline Markdown link or image ``[text](target)`` /
   ``![alt](target)`` and every reference definition ``[label]: target`` whose target
   has no URL scheme (``https:``, ``mailto:``, ...): the path part, URL-decoded, must
   exist relative to the Markdown file's directory (a leading ``/``: relative to the
   repository root, as GitHub resolves it) and lie inside the repository. An empty
   path is the file itself.
2. **Anchors.** A ``#anchor`` on a link to a Markdown file (or on ``#anchor`` alone,
   the same file) must be the slug of one of that file's headings, by GitHub's rules:
   the heading's rendered text (link syntax reduced to its text, backticks and HTML
   tags dropped), lowercased, every character that is not a letter, digit, ``_``,
   ``-`` or space dropped, each space turned into ``-``; a repeated slug gets ``-1``,
   ``-2``, ... in order. ``<a name=...>``/``id=`` anchors count too. On other files only
   GitHub's line anchors (``#L12``, ``#L12-L20``) are accepted.
3. **Cited paths in code spans.** A code span (single or multiple backticks, possibly
   over several lines of one paragraph) is a cited repository path when its content
   has no whitespace, consists only of ``A-Z a-z 0-9 _ . - / { } , * $`` (after an
   optional ``::test`` or ``:LINE`` suffix is cut off) and either

   a. contains ``/`` and its last component ends in one of ``PATH_EXTENSIONS`` or in
      ``.*`` (``bench/ops.py``, ``csrc/cuda/multi_tensor_block.cuh``,
      ``results/lean-cpu.{md,json,png}``, ``docs/*.md``, ``results/lean-cpu.*``), or
   b. ends with ``/`` and starts with one of the repository's top-level directories
      (``examples/fsdp/``, ``bench/results/lean-speed-avx2/``), or
   c. is a top-level file name: ``TOP_LEVEL_NAMES`` (``Makefile``, ``setup.py``, ...)
      or an upper-case Markdown name (``README.md``, ``DESIGN.md``).

   Braces expand (``a.{md,json}`` is two paths) and ``*`` globs (at least one match).
   A path exists when it resolves against the repository root or against the Markdown
   file's directory (``cpu/register.cpp`` in csrc/README.md).
4. **Cited paths in prose.** Outside code spans, links' targets and URLs: a word that
   starts with one of the repository's top-level directories and ends in one of
   ``PATH_EXTENSIONS`` (``bench/results/q8-formats-cpu.md``), or an upper-case Markdown
   name (``DESIGN.md``), resolved as in 3.

A cited path that is meant to lie outside the repository (another machine's files, a
file a run writes, another project's tree) is allowed only through ``EXCEPTIONS``, each
with its reason; an exception that no longer matches anything fails
``test_every_exception_is_used``, so the list cannot go stale.
"""

import fnmatch
import functools
import os
import pathlib
import posixpath
import re
import subprocess
import urllib.parse
from typing import Iterator, List, NamedTuple, Optional, Tuple

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

# What a cited file ends in (rule 3a and rule 4).
PATH_EXTENSIONS = ("py", "md", "cpp", "h", "cu", "cuh", "sh", "txt", "toml", "json", "log",
                   "png", "csv", "yml", "yaml", "cfg", "ini", "summary")
# Top-level files cited by bare name (rule 3c), besides upper-case *.md names.
TOP_LEVEL_NAMES = ("Makefile", "setup.py", "pyproject.toml", ".clang-format", ".gitignore",
                   "Dockerfile")

# (Markdown files, cited path, reason): fnmatch patterns (braces expand), the first over
# the Markdown file's path from the root, the second over the cited path as written.
# Consulted only for a path that is not in the repository.
EXCEPTIONS: List[Tuple[str, str, str]] = [
    ("*", "$OUT/*",
     "files a GPU run writes under the device machine's $OUT folder (scripts/gpu_check.sh)"),
    ("*", "build/*",
     "build outputs that make writes (build/ is in .gitignore)"),
    ("*", "mixedprec/_build_info.py",
     "written by every build of the extension (setup.py), in .gitignore"),
    ("bench/README.md", "bench/results/cpu-smoke/",
     "where the benchmarks' CPU smoke runs write (in .gitignore: never read as results)"),
    ("docs/torch-suite.md", "test/*",
     "PyTorch's own test suite (pytorch/pytorch's test/), which scripts/torch_suite.py runs"),
    ("docs/compatibility.md", "ATen/ATen.h",
     "a header of torch's C++ API, quoted for its error message"),
    ("csrc/README.md", "{ATen,c10,torch}/*",
     "torch's C++ headers (torch/include in its wheel), which the extension includes"),
]

CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
# [text](target "title"): the text may hold one level of brackets; group 2 is the target.
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]"
                  r"\(\s*(<[^>\n]*>|[^)\s]*)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*(<[^>\n]*>|\S+)", re.M)
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s[^>]*\b(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
SCHEME = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*:|//)")
URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://\S+")
LINE_ANCHOR = re.compile(r"^L\d+(?:-L\d+)?$")
PATH_CHARS = re.compile(r"^[A-Za-z0-9_.\-/{},*$]+$")
UPPER_MD = re.compile(r"^[A-Z][A-Z0-9_-]*\.md$")


class Finding(NamedTuple):
    file: str  # from the root
    line: int
    text: str  # as written


# --- the files ----------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def repo_files() -> frozenset:
    """The repository's files, from the root: tracked or untracked but not ignored (git
    ls-files -c -o --exclude-standard), present in the working tree. Where this is no
    git checkout of its own (make compat's copy under build/), every file outside .git,
    .venv*, build and shared that .gitignore's patterns leave (the extension built in
    place there). Build outputs and ignored run outputs are not the repository's: a doc
    that cites one cites it through EXCEPTIONS."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.strip()
        if pathlib.Path(top).resolve() == REPO:
            names = subprocess.run(
                ["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=REPO,
                capture_output=True, text=True, check=True).stdout
            return frozenset(n for n in names.split("\0") if n and (REPO / n).is_file())
    except (OSError, subprocess.CalledProcessError):
        pass
    out = set()
    for root, dirs, files in os.walk(REPO):
        here = pathlib.Path(root).relative_to(REPO)
        if here == pathlib.Path("."):
            dirs[:] = [d for d in dirs if d not in (".git", "build", "shared")
                       and not d.startswith(".venv")]
        dirs[:] = [d for d in dirs if d not in ("__pycache__", ".pytest_cache")]
        out.update((here / f).as_posix() for f in files)
    return frozenset(f for f in out if not ignored(f))


@functools.lru_cache(maxsize=None)
def gitignore_patterns() -> Tuple[str, ...]:
    gitignore = REPO / ".gitignore"
    if not gitignore.is_file():
        return ()
    lines = (line.strip() for line in gitignore.read_text(encoding="utf-8").split("\n"))
    return tuple(line for line in lines if line and not line.startswith("#"))


def ignored(path: str) -> bool:
    """Whether .gitignore's patterns ignore path (from the root): a pattern with a /
    matches from the root, one without matches any name on the way; a trailing /
    means a directory. (The repository's .gitignore uses no negation.)"""
    parts = path.split("/")
    for pattern in gitignore_patterns():
        directory = pattern.endswith("/")
        pattern = pattern.rstrip("/")
        if "/" in pattern:
            depth = pattern.count("/") + 1
            if fnmatch.fnmatch("/".join(parts[:depth]), pattern.lstrip("/")) and \
                    (len(parts) > depth or not directory):
                return True
        elif any(fnmatch.fnmatch(part, pattern)
                 for part in (parts[:-1] if directory else parts)):
            return True
    return False


@functools.lru_cache(maxsize=None)
def repo_dirs() -> frozenset:
    return frozenset(str(pathlib.PurePosixPath(f).parents[i])
                     for f in repo_files() for i in range(len(pathlib.PurePosixPath(f).parts) - 1))


def markdown_files() -> Tuple[str, ...]:
    """The repository's *.md files (committed ones, and new ones not yet committed)."""
    return tuple(sorted(f for f in repo_files() if f.endswith(".md")))


def top_level_dirs() -> Tuple[str, ...]:
    return tuple(sorted(d for d in repo_dirs() if "/" not in d))


def in_repo(path: str) -> Optional[str]:
    """path (from the root, may hold ../) normalised, when it is a file or a directory
    of the repository; else None."""
    norm = posixpath.normpath(path)
    if norm == ".":
        return norm
    return norm if norm in repo_files() or norm in repo_dirs() else None


def clear_caches() -> None:
    for cached in (repo_files, repo_dirs, anchors):
        cached.cache_clear()


def strip_fences(text: str) -> str:
    """The text with every fenced code block's lines (fences included) emptied, so that
    offsets keep their line numbers."""
    out, fence = [], None
    for line in text.split("\n"):
        m = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if fence is None and m:
            fence = m.group(1)
            out.append("")
        elif fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                    and not line.strip()[len(m.group(1)):].strip():
                fence = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def blank(text: str, start: int, end: int) -> str:
    """text with [start, end) replaced by spaces (newlines kept)."""
    return text[:start] + re.sub(r"[^\n]", " ", text[start:end]) + text[end:]


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def code_spans(text: str) -> Iterator[Tuple[int, str]]:
    """(offset, content) of every code span; one span never crosses a blank line."""
    for m in CODE_SPAN.finditer(text):
        if re.search(r"\n[ \t]*\n", m.group(2)):
            continue
        yield m.start(), m.group(2)


def without_code(text: str) -> str:
    for m in reversed(list(CODE_SPAN.finditer(text))):
        if not re.search(r"\n[ \t]*\n", m.group(2)):
            text = blank(text, m.start(), m.end())
    return text


# --- headings and their slugs -------------------------------------------------------


def slug_base(heading: str) -> str:
    """GitHub's anchor for a heading's text, before duplicates get their -N."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = "".join(c for c in text if c.isalnum() or c in "_- ")
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: pathlib.Path) -> frozenset:
    text = strip_fences(path.read_text(encoding="utf-8"))
    seen, out = {}, set()
    for m in HEADING.finditer(text):
        base = slug_base(m.group(2).strip())
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out.update(HTML_ANCHOR.findall(text))
    return frozenset(out)


# --- links --------------------------------------------------------------------------


def links(text: str) -> Iterator[Tuple[int, str]]:
    """(offset, target) of every inline link, image and reference definition outside
    code spans."""
    for m in LINK.finditer(text):
        yield m.start(2), m.group(2).strip("<>")
    for m in REFERENCE.finditer(text):
        yield m.start(2), m.group(2).strip("<>")


def check_link(md: str, target: str) -> Optional[str]:
    """None when the link resolves, else why not."""
    if SCHEME.match(target):
        return None
    path, _, anchor = target.partition("#")
    path = urllib.parse.unquote(path)
    if not path:
        dest = md
    else:
        joined = path.lstrip("/") if path.startswith("/") else posixpath.join(
            posixpath.dirname(md), path)
        if posixpath.normpath(joined).split("/")[0] == "..":
            return "outside the repository"
        dest = in_repo(joined)
        if dest is None:
            return "no such file or directory in the repository"
    if not anchor:
        return None
    anchor = urllib.parse.unquote(anchor)
    if dest.lower().endswith(".md") and dest in repo_files():
        return None if anchor in anchors(REPO / dest) else f"no heading with anchor #{anchor}"
    if dest in repo_files() and LINE_ANCHOR.match(anchor):
        return None
    return f"anchor #{anchor} on a file without headings"


def link_problems(md: str) -> List[Finding]:
    text = without_code(strip_fences((REPO / md).read_text(encoding="utf-8")))
    out = []
    for offset, target in links(text):
        why = check_link(md, target)
        if why:
            out.append(Finding(md, line_of(text, offset), f"link ({target}): {why}"))
    return out


# --- cited paths --------------------------------------------------------------------


def expand_braces(token: str) -> List[str]:
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [x for part in m.group(1).split(",")
            for x in expand_braces(token[:m.start()] + part + token[m.end():])]


def cited_in_code(content: str) -> Optional[str]:
    """The path a code span's content cites (rule 3), or None when it cites none."""
    token = content.strip()
    if not token or re.search(r"\s", token):
        return None
    token = re.sub(r"::.*$", "", token)
    token = re.sub(r":\d+(?:-\d+)?$", "", token)
    if not PATH_CHARS.match(token):
        return None
    if "/" in token:
        last = token.rstrip("/").rsplit("/", 1)[-1]
        if not token.endswith("/"):
            exts = {p.rsplit(".", 1)[-1] for p in expand_braces(last) if "." in p}
            return token if exts and exts <= {*PATH_EXTENSIONS, "*"} else None
        first = re.sub(r"^(?:\./)+", "", token).split("/", 1)[0]
        return token if first in top_level_dirs() and not token.startswith("../") else None
    if token in TOP_LEVEL_NAMES or UPPER_MD.match(token):
        return token
    return None


def cited_in_prose(text: str) -> Iterator[Tuple[int, str]]:
    """(offset, path) of the paths cited outside code spans, links' targets and URLs
    (rule 4); text already without fences and code spans."""
    for m in reversed(list(LINK.finditer(text))):
        text = blank(text, m.start(2), m.end(2))
    for m in reversed(list(URL.finditer(text))):
        text = blank(text, m.start(), m.end())
    dirs = "|".join(re.escape(d) for d in top_level_dirs())
    exts = "|".join(PATH_EXTENSIONS)
    path = re.compile(rf"(?<![\w./$~-])((?:{dirs})/[\w./-]*?\.(?:{exts})|[A-Z][A-Z0-9_-]*\.md)"
                      r"(?![\w/-])")
    for m in path.finditer(text):
        yield m.start(1), m.group(1)


def excepted(md: str, token: str) -> Optional[Tuple[str, str, str]]:
    for entry in EXCEPTIONS:
        files, pattern, _ = entry
        if fnmatch.fnmatchcase(md, files) and any(
                fnmatch.fnmatchcase(token, p) for p in expand_braces(pattern)):
            return entry
    return None


def glob_in_repo(pattern: str) -> bool:
    """Whether a pattern with * (not crossing a /) matches a file of the repository."""
    regex = re.compile("".join("[^/]*" if c == "*" else re.escape(c) for c in pattern) + "$")
    return any(regex.match(f) for f in repo_files())


def path_exists(md: str, token: str) -> bool:
    """Whether every path the token names (braces expanded) is in the repository, from
    the root or from the Markdown file's directory."""
    bases = ["", posixpath.dirname(md)]
    for path in expand_braces(token):
        found = False
        for base in bases:
            joined = posixpath.normpath(posixpath.join(base, path))
            if joined.split("/")[0] == "..":
                continue
            if glob_in_repo(joined) if "*" in path else in_repo(joined) is not None:
                found = True
                break
        if not found:
            return False
    return True


def cited_paths(md: str) -> Iterator[Tuple[int, str]]:
    text = strip_fences((REPO / md).read_text(encoding="utf-8"))
    for offset, content in code_spans(text):
        token = cited_in_code(content)
        if token:
            yield line_of(text, offset), token
    for offset, token in cited_in_prose(without_code(text)):
        yield line_of(text, offset), token


def path_problems(md: str, used: Optional[set] = None) -> List[Finding]:
    """The cited paths of md that are not in the repository and not excepted; used
    collects the EXCEPTIONS entries that excused one."""
    out = []
    for line, token in cited_paths(md):
        if path_exists(md, token):
            continue
        entry = excepted(md, token)
        if entry:
            if used is not None:
                used.add(entry)
            continue
        out.append(Finding(md, line, f"cited path {token}: not in the repository"))
    return out


def report(problems: List[Finding]) -> str:
    return "\n".join(f"{p.file}:{p.line}: {p.text}" for p in problems)


# --- the checks ---------------------------------------------------------------------


def test_the_markdown_files_are_found():
    files = markdown_files()
    for expected in ("README.md", "bench/README.md", "csrc/README.md", "docs/lean-precision.md"):
        assert expected in files
    assert not any(f.startswith(("build/", ".venv")) for f in files)


def test_gitignored_files_are_not_the_repositorys():
    """Where there is no git checkout (make compat's copy), the walk leaves out what
    .gitignore ignores, as git ls-files does: the extension built in place there."""
    for path in ("mixedprec/_build_info.py", "mixedprec/_C.abi3.so", "build/ext/x.o",
                 "bench/results/cpu-smoke/ops.json", "mixedprec/__pycache__/ops.cpython-311.pyc",
                 ".venv-compat-2.15.0/bin/python"):
        assert ignored(path), path
    for path in ("mixedprec/optim/adam.py", "bench/results/lean-speed-report/x.json",
                 "csrc/cpu/engine.h", "README.md", "tests/cpp/CMakeLists.txt"):
        assert not ignored(path), path


def test_every_link_and_anchor_resolves():
    problems = [p for md in markdown_files() for p in link_problems(md)]
    assert not problems, "broken links:\n" + report(problems)


def test_every_cited_path_exists():
    problems = [p for md in markdown_files() for p in path_problems(md)]
    assert not problems, (
        "cited paths that do not exist (fix the doc, or add an EXCEPTIONS entry with its "
        "reason when the path is meant to be outside the repository):\n" + report(problems))


def test_every_exception_is_used():
    used: set = set()
    for md in markdown_files():
        path_problems(md, used)
    stale = [e for e in EXCEPTIONS if e not in used]
    assert not stale, "EXCEPTIONS entries that match no cited path: " + repr(stale)


# --- README: the Layout block and the operators ---------------------------------------

NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty".split())}


def layout_entries(text: str) -> List[Tuple[int, str]]:
    """(line, path from the root) of every entry of the fenced block under README's
    "## Layout": a line indented by 0, 2, 4 or 6 spaces whose first word is the entry
    (followed by two spaces or the line's end); an entry at depth d > 0 is relative to
    the directory entry (ending in /) above it at depth d - 1. Lines indented 8 or more
    continue a description."""
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.strip() == "## Layout")
    first = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    out, stack = [], []
    for i in range(first + 1, len(lines)):
        line = lines[i]
        if line.startswith("```"):
            return out
        m = re.match(r"^( *)(\S+)(?: {2,}|$)", line)
        if not m or len(m.group(1)) >= 8:
            continue
        indent, token = len(m.group(1)), m.group(2)
        assert indent % 2 == 0, f"README.md:{i + 1}: indented by {indent}, not by steps of 2"
        depth = indent // 2
        assert depth <= len(stack) and (depth == 0 or stack[depth - 1]), (
            f"README.md:{i + 1}: {token} is not under a directory entry")
        path = (stack[depth - 1] if depth else "") + token
        stack = stack[:depth] + [path if token.endswith("/") else None]
        out.append((i + 1, path))
    raise AssertionError("README.md: the Layout block has no closing fence")


def test_the_readme_layout_names_what_exists():
    """Every entry of README's Layout is a file or directory of the repository, and
    every top-level directory of the repository has an entry."""
    entries = layout_entries((REPO / "README.md").read_text(encoding="utf-8"))
    missing = [Finding("README.md", line, f"layout entry {path}: not in the repository")
               for line, path in entries
               if any(in_repo(p.rstrip("/")) is None for p in expand_braces(path))]
    assert not missing, report(missing)
    named = {path.split("/", 1)[0] for _, path in entries}
    assert not set(top_level_dirs()) - named, (
        "top-level directories without a README Layout entry: "
        + ", ".join(sorted(set(top_level_dirs()) - named)))


def test_the_readme_counts_and_lists_the_registered_operators():
    """README's Operators table has one row per operator the dispatcher holds after
    ``import mixedprec``, and every "N operators" ("N ops", "N schemas") says N."""
    import torch

    import mixedprec  # noqa: F401  (loads the extension, which registers the operators)

    registered = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
                        if n.startswith("mixedprec::"))
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert sorted(re.findall(r"^\| `(\w+)\(", text, re.M)) == registered
    words = "|".join(NUMBER_WORDS)
    counts = [(line_of(text, m.start()), m.group(0)) for m in re.finditer(
        rf"\b(\d+|{words}) (?:operators|ops|schemas)\b", text, re.I)]
    assert counts, "README.md does not say how many operators there are"
    wrong = [f"README.md:{line}: {said}" for line, said in counts
             if int(NUMBER_WORDS.get(said.split()[0].lower(), said.split()[0])) != len(registered)]
    assert not wrong, f"the dispatcher holds {len(registered)} operators:\n" + "\n".join(wrong)


# --- the checker on planted text ----------------------------------------------------


@pytest.mark.parametrize("heading, slug", [
    ("Two commands", "two-commands"),
    ("`bench/host_step.py`", "benchhost_steppy"),
    ("Results: NVIDIA H100 80GB HBM3 (2026-11-24)", "results-nvidia-h100-80gb-hbm3-2026-11-24"),
    ("8-bit moments", "8-bit-moments"),
    ("The [Apex](https://github.com/NVIDIA/apex) alias", "the-apex-alias"),
    ("a - b", "a---b"),
])
def test_slugs_follow_github(heading, slug):
    assert slug_base(heading) == slug


def test_duplicate_headings_get_numbered(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Notes\n\n```\n# Fenced\n```\n\n## Notes\n\n## Notes\n")
    assert anchors(page) == {"notes", "notes-1", "notes-2"}


@pytest.mark.parametrize("content, cited", [
    ("bench/ops.py", "bench/ops.py"),
    ("csrc/cuda/multi_tensor_block.cuh", "csrc/cuda/multi_tensor_block.cuh"),
    ("tests/python/optim/test_lean.py::test_none", "tests/python/optim/test_lean.py"),
    ("results/lean-cpu.{md,json,png}", "results/lean-cpu.{md,json,png}"),
    ("results/lean-cpu.*", "results/lean-cpu.*"),
    (".ci/", ".ci/"),
    ("./bench/ops.py:12", "./bench/ops.py"),
    ("examples/fsdp/", "examples/fsdp/"),
    ("DESIGN.md", "DESIGN.md"),
    ("Makefile", "Makefile"),
    ("ops.py", None),  # a bare name: which ops.py is ambiguous
    ("fp16/bf16", None),
    ("mixedprec.optim.Adam/AdamW/SGD", None),
    ("nvcr.io/nvidia/pytorch:25.12-py3", None),
    ("python -m mixedprec.selfcheck", None),
    ("train/", None),  # not one of the repository's directories
])
def test_which_code_spans_cite_paths(content, cited):
    assert cited_in_code(content) == cited


def test_layout_entries_nest():
    text = ("## Layout\n\n```\na/                 A\n  b/               B\n"
            "    c.py           C\n                   more about c\n  d.h              D\n"
            "e.{h,cpp}          E\n```\n")
    assert [p for _, p in layout_entries(text)] == ["a/", "a/b/", "a/b/c.py", "a/d.h",
                                                     "e.{h,cpp}"]


def test_planted_problems_are_reported(tmp_path, monkeypatch):
    """A copy of the checker's view on a planted file: each kind of problem shows with
    its file and line, and what exists passes."""
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    clear_caches()
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "ops.py").write_text("")
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## Its `part`\n")
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\n"
        "[ok](other.md#its-part) [ok](#page) [ok](../bench/ops.py#L3) [web](https://x.org/a)\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [up](../../up.md)\n"
        "`bench/ops.py` and `bench/gone.py`, over\n"
        "two lines: `from x import\ny` and bench/ops.py and bench/prose.py; DESIGN.md\n"
        "```\n`bench/in_fence.py` [x](in_fence.md)\n```\n"
        "`$OUT/gpu_check.log`\n")
    try:
        found = link_problems("docs/page.md") + path_problems("docs/page.md")
    finally:
        clear_caches()
    assert report(found).splitlines() == [
        "docs/page.md:4: link (missing.md): no such file or directory in the repository",
        "docs/page.md:4: link (other.md#nope): no heading with anchor #nope",
        "docs/page.md:4: link (../../up.md): outside the repository",
        "docs/page.md:5: cited path bench/gone.py: not in the repository",
        "docs/page.md:7: cited path bench/prose.py: not in the repository",
        "docs/page.md:7: cited path DESIGN.md: not in the repository",
    ]
