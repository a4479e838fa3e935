"""Rules of the package's shape that hold after every change: modules that each say their one
job, no private name used across modules, commands that do not import each other."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ema_ckpt"


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_says_its_job_in_its_first_docstring_line():
    missing = []
    for module in _modules():
        doc = ast.get_docstring(ast.parse(module.read_text()))
        if not doc or len(doc.splitlines()[0].strip()) < 10:
            missing.append(str(module.relative_to(PACKAGE)))
    assert missing == []


def test_commands_do_not_import_each_other():
    """What two commands share lives a floor down (selection, integrity, jobs), not in a command."""
    commands = {p.stem for p in (PACKAGE / "commands").glob("*.py")} - {"__init__"}
    found = []
    for module in (PACKAGE / "commands").glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module in commands:
                found.append(f"{module.stem} -> {node.module}")
            if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module == "commands":
                found.append(f"{module.stem} -> commands")
    assert found == []


# --- private names stay in their module ----------------------------------------------------------

_ALLOWED_EVERYWHERE = {("os", "_exit")}  # public API despite its name; any other (sys._getframe) only in _compat


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package_module(name: str) -> bool:
    """Whether ``name`` (``ema_ckpt.x.y``) is a module or package of ema_ckpt."""
    if name.split(".")[0] != PACKAGE.name:
        return False
    base = PACKAGE.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _private_uses(path: Path, source: str | None = None) -> list[str]:
    """The private names ``path`` takes from another module: ``from x import _name`` and
    ``module._name`` on an imported module (a name bound by an import: ``import x``, ``from .
    import x``, the lazy ``torch``), each as ``module._name``. A package-private module imported
    as a module (``from .. import _gc``) is no private name; dunder names are none either. A
    private name read by ``getattr(module, "_name")`` counts too."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text() if source is None else source)
    imported: dict[str, str] = {}  # local name -> what it names (a dotted path)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if any(_private(part) for part in alias.name.split(".")) and not _is_package_module(alias.name):
                    found.append(alias.name)
                imported[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname \
                    else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(parts + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                full = f"{origin}.{alias.name}"
                imported[alias.asname or alias.name] = "torch" if full == "ema_ckpt._lazy.torch" else full
                if _private(alias.name) and not _is_package_module(full):
                    found.append(full)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in imported \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _private(node.args[1].value):  # getattr(pickle, "_Unpickler", None)
            found.append(f"{imported[node.args[0].id]}.{node.args[1].value}")
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, root = [node.attr], node.value
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in imported:
                chain.reverse()
                if not any(_private(part) for part in chain[:-1]):  # the first private part only
                    full = ".".join([imported[root.id], *chain])
                    if not _is_package_module(full):
                        found.append(full)
    return sorted(found)


def _crossing(use: str, in_compat: bool) -> bool:
    """Whether a private name ``use`` (``module._name``) may not be used where it is."""
    module, _, name = use.rpartition(".")
    if module.split(".")[0] == "ema_ckpt":
        return True  # another module's private name (a module's own are never imported)
    if (module, name) in _ALLOWED_EVERYWHERE:
        return False
    return not in_compat  # torch's and Python's private names live there, each with a conformance test


def test_no_module_uses_a_private_name_of_another_module_or_of_torch():
    """What two modules share is a documented public name of one of them; a private name of
    torch (or of Python's standard library) is used only in ema_ckpt/_compat/, where
    tests/test_compat.py checks it against the installed version."""
    found = []
    for module in _modules():
        in_compat = module.relative_to(PACKAGE).parts[0] == "_compat"
        for use in _private_uses(module):
            if _crossing(use, in_compat):
                found.append(f"{module.relative_to(PACKAGE)}: {use}")
    assert found == []


def test_the_private_name_check_sees_each_kind_of_use():
    """The check above finds what it looks for (a check that finds nothing proves nothing)."""
    module = PACKAGE / "formats" / "deepspeed" / "example.py"
    source = (
        "import os\nimport sys\nimport pickle\nimport torch._C\nimport ema_ckpt._gc\nimport _compat_pickle\n"
        "from torch import _weights_only_unpickler\n"
        "from ..._lazy import torch\nfrom ... import _gc\nfrom ...engine import blas_probe\n"
        "from .params import _Entry, Entry\n"
        "os._exit(0); sys._getframe(); torch._utils._element_size(1); torch.__version__\n"
        "blas_probe._Sweep; blas_probe.Sweep; _gc.paused_gc; self._x; getattr(pickle, '_Stop', None)\n"
    )
    uses = _private_uses(module, source)
    assert [use for use in uses if _crossing(use, in_compat=False)] == [
        "_compat_pickle", "ema_ckpt.engine.blas_probe._Sweep", "ema_ckpt.formats.deepspeed.params._Entry",
        "pickle._Stop", "sys._getframe", "torch._C", "torch._utils", "torch._weights_only_unpickler"]
    assert [use for use in uses if _crossing(use, in_compat=True)] == [
        "ema_ckpt.engine.blas_probe._Sweep", "ema_ckpt.formats.deepspeed.params._Entry"]
