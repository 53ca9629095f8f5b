"""The sealed seams (``spec/backends.md``, "Where each kind of code lives"), checked over the source: no module uses
another's privates, no sub-package builds on another's underscore modules, no engine
imports a peer engine, no module outgrows one idea, and no test imports another test file.

A name with a leading underscore belongs to the module that defines it. Another module
may import a private *module* of its own package (``leanstate._backends``) and use its
public names, but never reach for ``_name`` in another module, directly
(``from m import _name``) or through an object (``store._engine``). The only foreign
privates allowed are torch's own multi-tensor ops, listed here by name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOTS = {"compat": "leanstate", "reference": "leanstate.reference", "accelerated": "leanstate.accelerated"}


def _packages() -> dict[str, str]:
    """Every package folder of the source tree (one with ``__init__.py``) -> its import name:
    derived from the tree, so a new sub-package is guarded by default."""
    found = {}
    for root, package in ROOTS.items():
        for init in sorted((ROOT / root).rglob("__init__.py")):
            folder = init.parent.relative_to(ROOT).as_posix()
            found[folder] = package + "".join(
                "." + part for part in init.parent.relative_to(ROOT / root).parts
            )
    return found


FOLDERS = _packages()
MODULES = sorted(p for folder in FOLDERS for p in (ROOT / folder).glob("*.py"))
ENGINE_PREFIXES = ("numba_cuda_", "numba_", "torch_")
# torch's multi-tensor ops (torch.nn.utils.clip_grad_norm_ uses them the same way)
FOREIGN_ALLOWED = {"_foreach_norm", "_foreach_mul_"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_here(tree: ast.Module) -> set[str]:
    """Every private name the module itself defines: functions, classes, assignments,
    attributes it assigns (``self._x = ...``) and parameters."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if _private(n)}


def _private_module_exists(package: str, name: str) -> bool:
    folder = next((f for f, pkg in FOLDERS.items() if pkg == package), None)
    return folder is not None and (ROOT / folder / f"{name}.py").exists()


def foreign_privates(path: Path) -> list[str]:
    """``file:line: what`` for every use of another module's private name in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    mine = _defined_here(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("leanstate"):
            for alias in node.names:
                if _private(alias.name) and not _private_module_exists(node.module, alias.name):
                    found.append(f"{path.name}:{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if node.attr in mine or node.attr in FOREIGN_ALLOWED:
                continue
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_there_are_modules_to_check():
    assert len(MODULES) > 20


@pytest.mark.parametrize("path", MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_module_uses_another_modules_private_names(path):
    assert foreign_privates(path) == []


def _imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """``(line, module)`` for each leanstate module ``path`` imports, relative imports
    resolved and ``from package import module`` counted as that module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.append((node.lineno, module))
            found += [
                (node.lineno, f"{module}.{a.name}")
                for a in node.names
                if _private_module_exists(module, a.name)
            ]
    return [(line, m) for line, m in found if m.split(".")[0] == "leanstate"]


def foreign_private_modules(path: Path, package: str) -> list[str]:
    """``file:line: module`` for each import of an underscore module that belongs to neither
    ``package`` (the importer's) nor a package above it: another sub-package's internals,
    which it may use only through that sub-package's declared surface (``checkpoint/core.py``)."""
    packages = set(FOLDERS.values()) | {package}
    found = []
    for line, module in _imported_modules(path, package):
        parts = module.split(".")
        owner = next(".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in packages)
        rest = parts[len(owner.split(".")) :]
        mine = package == owner or package.startswith(owner + ".")
        if rest and _private(rest[0]) and not mine:
            found.append(f"{path.name}:{line}: {module}")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_sub_package_imports_another_sub_packages_underscore_modules(path):
    assert foreign_private_modules(path, FOLDERS[path.parent.relative_to(ROOT).as_posix()]) == []


def test_the_sub_package_check_catches_a_reach_into_the_checkpoint_core(tmp_path):
    leaky = tmp_path / "leaky.py"
    leaky.write_text(
        "from leanstate.checkpoint._files import publish\n"
        "from leanstate.checkpoint import _chunks\n"
        "from ..checkpoint._format import DTYPES\n"
        "import leanstate.checkpoint._ranks\n"
        "from leanstate.checkpoint.core import publish\n"  # the declared surface
        "from leanstate._backends import available\n"  # the package's own, above dcp
        "from leanstate.dcp._state import split_key\n"  # dcp's own
        "from . import _sources\n"
    )
    assert foreign_private_modules(leaky, "leanstate.dcp") == [
        "leaky.py:1: leanstate.checkpoint._files",
        "leaky.py:2: leanstate.checkpoint._chunks",
        "leaky.py:3: leanstate.checkpoint._format",
        "leaky.py:4: leanstate.checkpoint._ranks",
    ]
    assert foreign_private_modules(leaky, "leanstate.checkpoint") == ["leaky.py:7: leanstate.dcp._state"]


ERROR_HOME = "leanstate.reference.checkpoint_manifest"


def checkpoint_error_imports(path: Path) -> list[str]:
    """Where ``path`` imports ``CheckpointError`` from anywhere but the module defining it."""
    return [
        f"{path.name}:{node.lineno}: from {node.module}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and any(alias.name == "CheckpointError" for alias in node.names)
        and node.module != ERROR_HOME
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_checkpoint_error_is_imported_from_its_one_definition(path):
    """Textbook and hardened code raise one class, imported from where it is defined (not
    through the textbook's loader or the hardened schema)."""
    assert checkpoint_error_imports(path) == []


def test_the_error_check_catches_an_import_through_another_module(tmp_path):
    relay = tmp_path / "relay.py"
    relay.write_text(
        "from leanstate.reference.checkpoint import FORMAT_NAME, CheckpointError\n"
        "from leanstate.reference.checkpoint_manifest import CheckpointError\n"
        "from leanstate.checkpoint._format import CheckpointError as Error\n"
    )
    assert checkpoint_error_imports(relay) == [
        "relay.py:1: from leanstate.reference.checkpoint",
        "relay.py:3: from leanstate.checkpoint._format",
    ]


CHECKPOINT_PACKAGES = ("compat/checkpoint", "compat/dcp")
each_checkpoint_module = pytest.mark.parametrize(
    "path",
    [p for p in MODULES if p.parent.relative_to(ROOT).as_posix() in CHECKPOINT_PACKAGES],
    ids=lambda p: f"{p.parent.name}/{p.name}",
)


def _outside(path: Path, functions: tuple[str, ...]) -> list[ast.AST]:
    """The nodes of ``path`` that lie outside every function named in ``functions``."""
    tree = ast.parse(path.read_text())
    inside = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef) and function.name in functions
        for node in ast.walk(function)
    }
    return [node for node in ast.walk(tree) if id(node) not in inside]


def mark_assignments(path: Path) -> list[str]:
    """Where ``path`` sets a store's change mark (``x.mark = ...``) outside ``set_marks``."""
    return [
        f"{path.name}:{node.lineno}"
        for node in _outside(path, ("set_marks",))
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Attribute) and t.attr == "mark" for t in node.targets)
    ]


@each_checkpoint_module
def test_checkpoints_set_marks_in_one_place(path):
    """Saves, loads and the follower of both versions move the marks through set_marks."""
    assert mark_assignments(path) == []


def test_the_mark_check_catches_a_mark_set_elsewhere(tmp_path):
    module = tmp_path / "marks.py"
    module.write_text(
        "def set_marks(stores, digest):\n    for s in stores:\n        s.mark = digest\n"
        "def apply(store, digest):\n    store.mark = digest\n"
    )
    assert mark_assignments(module) == ["marks.py:5"]


def change_captures(path: Path) -> list[str]:
    """Where ``path`` captures what a save writes (``x.next_epoch()``, ``x.changes(...)``)
    outside the one writer (``_writer.write_checkpoint``) and ``set_marks``."""
    return [
        f"{path.name}:{node.lineno}: {node.func.attr}"
        for node in _outside(path, ("write_checkpoint", "set_marks"))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("next_epoch", "changes")
    ]


@each_checkpoint_module
def test_every_save_goes_through_the_one_writer(path):
    """Full and delta saves of both versions capture epochs and changes in write_checkpoint."""
    assert change_captures(path) == []


def test_the_writer_check_catches_a_save_of_its_own(tmp_path):
    module = tmp_path / "saves.py"
    module.write_text(
        "def write_checkpoint(stores):\n    return [s.next_epoch() for s in stores]\n"
        "def save_delta(store):\n    epoch = store.next_epoch()\n    return epoch, store.changes(since=0)\n"
    )
    assert change_captures(module) == ["saves.py:4: next_epoch", "saves.py:5: changes"]


TEXTBOOK_FORMAT = (
    "reference/checkpoint_manifest.py",
    "reference/delta_checkpoint.py",
    "reference/checkpoint.py",
)


def _constants(tree: ast.Module) -> dict[str, ast.expr]:
    """A module's top-level UPPER_CASE assignments: name -> the value's expression."""
    found = {}
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        for target in targets:
            if isinstance(target, ast.Name) and target.id.isupper() and node.value is not None:
                found[target.id] = node.value
    return found


def restated_facts(path: Path, textbook: list[Path]) -> list[str]:
    """``file:line: NAME`` where ``path`` gives one of the textbook's format constants a value
    of its own (an alias of an imported name is not a second definition)."""
    facts = {name for book in textbook for name in _constants(ast.parse(book.read_text()))}
    return [
        f"{path.name}:{value.lineno}: {name}"
        for name, value in _constants(ast.parse(path.read_text())).items()
        if name in facts and not isinstance(value, ast.Name)
    ]


@pytest.mark.parametrize(
    "path", [p for p in MODULES if p.parent == ROOT / "compat/checkpoint"], ids=lambda p: p.name
)
def test_the_checkpoint_core_defines_no_format_fact_twice(path):
    """Every constant of the format is the textbook's, imported; none restated beside it."""
    assert restated_facts(path, [ROOT / book for book in TEXTBOOK_FORMAT]) == []


def test_the_fact_check_catches_a_restated_constant(tmp_path):
    book, module = tmp_path / "book.py", tmp_path / "core.py"
    book.write_text("MAX_NAME_BYTES = 200\nFORMAT_VERSION = 1\n")
    module.write_text(
        "from book import FORMAT_VERSION\nVERSION_TWO = 2\nSAME = FORMAT_VERSION\n"
        "FORMAT_VERSION = FORMAT_VERSION\nMAX_NAME_BYTES: int = 200\n"
    )
    assert restated_facts(module, [book]) == ["core.py:5: MAX_NAME_BYTES"]


def _backend_of(module: str) -> str | None:
    """The backend an ``accelerated`` engine module belongs to (``numba_cuda_kv_store`` ->
    ``numba_cuda``), or None for a shared private module."""
    return next((prefix[:-1] for prefix in ENGINE_PREFIXES if module.startswith(prefix)), None)


def peer_engine_imports(path: Path) -> list[str]:
    """``file:line: module`` for each import of another backend's engine module."""
    mine = _backend_of(path.stem)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            if name.startswith("leanstate.accelerated."):
                other = _backend_of(name.rsplit(".", 1)[1])
                if other is not None and other != mine:
                    found.append(f"{path.name}:{node.lineno}: {name}")
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "accelerated").glob("*.py")), ids=lambda p: p.name)
def test_no_engine_imports_a_peer_engine(path):
    """What two backends share lives in a shared private module, never in a peer engine."""
    assert peer_engine_imports(path) == []


def test_the_peer_check_catches_a_peer_import(tmp_path):
    leaky = tmp_path / "numba_cuda_kv_store.py"
    leaky.write_text(
        "from leanstate.accelerated.torch_kv_store import RowPool\n"
        "from leanstate.accelerated.numba_cuda_kv_store import launch\n"
        "from leanstate.accelerated._row_pool import RowPool\n"
    )
    assert peer_engine_imports(leaky) == ["numba_cuda_kv_store.py:1: leanstate.accelerated.torch_kv_store"]


SOURCE_FOLDERS = ("compat", "reference", "accelerated")


@pytest.mark.parametrize(
    "path",
    sorted(p for folder in SOURCE_FOLDERS for p in (ROOT / folder).rglob("*.py")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_source_module_is_over_600_lines(path):
    assert len(path.read_text().splitlines()) <= 600


@pytest.mark.parametrize(
    "path", sorted((ROOT / "tests").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_no_test_file_imports_another_test_file(path):
    """Shared helpers live in ``tests/harness.py`` and helper modules, not in test files."""
    this = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests."):
            leaf = node.module.rsplit(".", 1)[1]
            assert not leaf.startswith("test_") or node.module == this, (
                f"{path.name}:{node.lineno}: {node.module}"
            )


def test_the_check_catches_a_reach_into_an_engine(tmp_path):
    leaky = tmp_path / "leaky.py"
    leaky.write_text(
        "from leanstate.reference.checkpoint import _checksum\n"
        "def f(store):\n    return store._engine.rows\n"
        "class Mine:\n    def __init__(self):\n        self._own = 1\n"
        "def g(other):\n    return other._own\n"
    )
    assert foreign_privates(leaky) == [
        "leaky.py:1: from leanstate.reference.checkpoint import _checksum",
        "leaky.py:3: store._engine",
    ]


def deferred_imports(path: Path, numpy_too: bool) -> list[str]:
    """Where ``path`` imports a leanstate module (and numpy, with ``numpy_too``) inside a
    function or class body instead of at the top, where the import graph shows it."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    for node in tree.body:  # an ``if TYPE_CHECKING:`` or ``try:`` block at the top is the top too
        if isinstance(node, ast.If | ast.Try):
            top.update(id(n) for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in top:
            continue
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
        if any(n.split(".")[0] == "leanstate" or (numpy_too and n.split(".")[0] == "numpy") for n in names):
            found.append(f"{path.name}:{node.lineno}: {names[0]}")
    return found


@pytest.mark.parametrize(
    "path",
    [p for p in MODULES if not p.parent.relative_to(ROOT).as_posix().startswith("compat/_tools")],
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_the_library_imports_its_modules_at_the_top(path):
    """No module of the library is imported on first use (the command line's subcommands,
    in ``_tools``, are); the checkpoint packages take numpy from ``leanstate._numpy``."""
    in_checkpoints = path.parent.relative_to(ROOT).as_posix() in CHECKPOINT_PACKAGES
    assert deferred_imports(path, numpy_too=in_checkpoints) == []


def test_the_import_check_catches_an_import_on_first_use(tmp_path):
    module = tmp_path / "lazy.py"
    module.write_text(
        "import torch\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import numpy\n"
        "def _chain():\n    from leanstate.checkpoint import _chain\n    return _chain\n"
        "def rows():\n    import numpy as np\n    import torch.distributed\n"
    )
    assert deferred_imports(module, numpy_too=False) == ["lazy.py:6: leanstate.checkpoint"]
    assert deferred_imports(module, numpy_too=True) == ["lazy.py:6: leanstate.checkpoint", "lazy.py:9: numpy"]
