"""The package's layout: the core never imports Apex's faces (mixedprec.compat), and
every import path users have keeps working."""

import ast
import importlib
import pathlib
import subprocess
import sys

import mixedprec

PACKAGE = pathlib.Path(mixedprec.__file__).parent
# The old top-level names of the faces: files that only alias mixedprec.compat.<name>.
ALIASES = set(mixedprec._FACES)


def core_files():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in ("compat", "apex"):
            continue
        if len(relative.parts) == 1 and relative.stem in ALIASES:
            continue
        yield relative, path


def imported_names(relative, tree):
    """Every module an import statement in the file names, resolved to an absolute
    dotted name."""
    package = ["mixedprec", *relative.parts[:-1]]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def test_core_files_import_no_face():
    faces = {f"mixedprec.{name}" for name in ALIASES} | {"mixedprec.compat", "mixedprec.apex"}
    offenders = []
    for relative, path in core_files():
        tree = ast.parse(path.read_text(), str(path))
        for name in imported_names(relative, tree):
            if any(name == face or name.startswith(face + ".") for face in faces):
                offenders.append(f"{relative}: {name}")
    assert offenders == []


def test_importing_the_core_loads_no_face():
    core = [f"mixedprec.{'.'.join(r.with_suffix('').parts)}".removesuffix(".__init__")
            for r, _ in core_files() if r.stem != "__main__"]
    code = ("import sys\n"
            f"for name in {core!r}:\n"
            "    __import__(name)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('mixedprec.compat', "
            "'mixedprec.apex', 'apex'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_old_import_paths_are_the_faces():
    for name in ALIASES:
        old = importlib.import_module(f"mixedprec.{name}")
        assert old is importlib.import_module(f"mixedprec.compat.{name}")
        assert getattr(mixedprec, name) is old
    from mixedprec.amp import initialize
    from mixedprec.compat import amp, optimizers
    from mixedprec.optimizers import FusedAdam
    assert initialize is amp.initialize
    assert FusedAdam is optimizers.FusedAdam is mixedprec.FusedAdam
    for name in mixedprec._APEX_OPTIMIZERS:
        assert getattr(mixedprec, name) is getattr(optimizers, name)
