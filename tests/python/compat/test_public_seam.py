"""The Apex faces (mixedprec/compat/) use only public names of the core: no import of
an underscore name or module from it, no underscore attribute of a core module, and no
call of a core object's underscore method other than through ``self``/``super()``
(a face subclass overriding the base's hooks is its own business)."""

import ast
from pathlib import Path

import mixedprec.optim

PACKAGE = Path(mixedprec.optim.__file__).resolve().parents[1]
COMPAT = sorted((PACKAGE / "compat").glob("*.py"))
CORE = sorted(p for p in PACKAGE.rglob("*.py")
              if "compat" not in p.relative_to(PACKAGE).parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_names(paths):
    """Underscore names defined in ``paths``: functions, methods, classes, and attributes
    assigned on ``self``."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return {n for n in names if _private(n)}


def _core_imports(tree):
    """(line, module, name) of every name compat imports from the core, and the local
    names bound to core modules."""
    imported, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            relative_core = node.level == 2 or (node.level == 0 and (node.module or "")
                                                .startswith("mixedprec")
                                                and ".compat" not in node.module)
            if not relative_core:
                continue
            for alias in node.names:
                imported.append((node.lineno, node.module or "", alias.name))
                if node.module is None:  # from .. import ops
                    modules.add(alias.asname or alias.name)
    return imported, modules


def _import_violations(path):
    imported, _ = _core_imports(ast.parse(path.read_text()))
    return [f"{path.name}:{line}: from ..{module} import {name}"
            for line, module, name in imported
            if _private(name) or any(_private(part) for part in module.split("."))]


def _attribute_violations(path, core_private):
    tree = ast.parse(path.read_text())
    _, modules = _core_imports(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in modules:
            found.append(f"{path.name}:{node.lineno}: {owner.id}.{node.attr}")
        elif node.attr in core_private and not (
                isinstance(owner, ast.Name) and owner.id in ("self", "cls") or
                isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and
                owner.func.id == "super"):
            found.append(f"{path.name}:{node.lineno}: .{node.attr} of a core object")
    return found


def test_compat_imports_only_public_core_names():
    found = [v for path in COMPAT for v in _import_violations(path)]
    assert not found, "compat/ imports private core names:\n" + "\n".join(found)


def test_compat_uses_no_private_core_attribute():
    core_private = _defined_names(CORE) - _defined_names(COMPAT)
    assert "_grads_by_device" in core_private  # (the scan sees the base's methods)
    found = [v for path in COMPAT for v in _attribute_violations(path, core_private)]
    assert not found, "compat/ reaches into the core's private names:\n" + "\n".join(found)


def test_the_scan_finds_what_it_looks_for(tmp_path):
    """A face that imports a private name, reads a core module's private attribute and
    calls a core object's private method is caught three times; through self, not."""
    face = tmp_path / "face.py"
    face.write_text("from ..optim.optimizer import _Hidden\nfrom .. import ops\n"
                    "ops._secret()\nopt._grads_by_device(group)\n"
                    "self._grads_by_device(group)\nsuper()._grads_by_device(group)\n")
    assert len(_import_violations(face)) == 1
    assert [v.split(": ")[1] for v in _attribute_violations(face, {"_grads_by_device"})] == [
        "ops._secret", "._grads_by_device of a core object"]
