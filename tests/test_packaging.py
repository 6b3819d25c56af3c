"""What the package promises about itself: its version, what `import fusedpc` pulls in, the
removed names that are refused with their new place, the deprecation helper, what
pyproject.toml declares, and the layer rule.

The layer rule: the subpackages are layers, in order

    core < parts < transformer < execution < training < {cli, bench}

and a module may import only from its own layer or the layers below it, at module level or
inside a function alike. `fusedpc/_version.py` and `fusedpc/_deprecation.py` (the one helper
for deprecation warnings) import nothing of fusedpc, and any module may import them. The
top-level façades (`fusedpc/__init__.py`, `frozen.py`, `losses.py`, `transplant.py`) may
import anything; since they import the training layer, they sit above it: only `cli` and `bench` may
import them.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import json
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

import fusedpc

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "fusedpc"

LAYERS = {"core": 0, "parts": 1, "transformer": 2, "execution": 3, "training": 4, "cli": 5,
          "bench": 5}
FACADES = {"__init__", "frozen", "losses", "transplant"}
FACADE_RANK = 4.5  # above training (the façades import it), below cli and bench
VERSION_MODULE = "fusedpc._version"
# below every layer: they import nothing of fusedpc, and any module may import them
BASE_MODULES = (VERSION_MODULE, "fusedpc._deprecation")


def _python(code: str) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON line last, which is returned."""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- version
def test_version_is_the_installed_metadata_version():
    assert fusedpc.__version__ == importlib.metadata.version("fusedpc")


def test_installed_metadata_is_the_pyproject_version():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert importlib.metadata.version("fusedpc") == declared, (
        "the installed metadata is stale: reinstall with pip install -e \".[test]\""
    )


# --------------------------------------------------------------------------- import cost
@pytest.mark.slow
def test_import_fusedpc_does_not_import_matplotlib():
    loaded = _python(
        "import json, sys\n"
        "import fusedpc\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib')))\n"
    )
    assert loaded == [], f"import fusedpc imported {loaded[:5]}"


# --------------------------------------------------------------------------- removed names
# names that moved in 0.2 and were removed in 0.4.0 -> (the module they live in now, the
# attribute there or None for the module itself)
REMOVED = {
    "errors": ("fusedpc.losses", None),
    "models": ("fusedpc.transformer.reference", None),
    "data": ("fusedpc.training.data", None),
    "FiniteFlag": ("fusedpc.core", "FiniteFlag"),
    "Named": ("fusedpc.core", "Named"),
    "PartMetrics": ("fusedpc.core", "PartMetrics"),
    "Stacked": ("fusedpc.core", "Stacked"),
    "display_path": ("fusedpc.core", "display_path"),
    "expect_last_axis": ("fusedpc.core", "expect_last_axis"),
    "expect_rank": ("fusedpc.core", "expect_rank"),
    "join_path": ("fusedpc.core", "join_path"),
    "learning_metrics": ("fusedpc.core", "learning_metrics"),
    "named": ("fusedpc.core", "named"),
    "replace_fields": ("fusedpc.core", "replace_fields"),
    "host_memory_env": ("fusedpc.training", "host_memory_env"),
    "host_memory_reused": ("fusedpc.training", "host_memory_reused"),
    "reuse_host_memory": ("fusedpc.training", "reuse_host_memory"),
    "emulate_cpu_devices": ("fusedpc.training", "emulate_cpu_devices"),
}


@pytest.mark.parametrize("name", sorted(REMOVED))
def test_a_removed_name_is_refused_naming_its_new_place(name):
    module, attribute = REMOVED[name]
    place = module if attribute is None else f"{module}.{attribute}"
    new = importlib.import_module(module)
    assert attribute is None or hasattr(new, attribute), f"{place} does not exist"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused, not forwarded with a warning
        with pytest.raises(AttributeError) as caught:
            getattr(fusedpc, name)
    assert str(caught.value) == f"fusedpc.{name} was removed in 0.4.0; use {place}"
    assert (caught.value.name, caught.value.obj) == (name, fusedpc)
    assert not hasattr(fusedpc, name)
    assert name not in dir(fusedpc)


def test_the_removed_names_are_only_those():
    from fusedpc import _REMOVED

    assert set(_REMOVED) == set(REMOVED)
    assert not set(REMOVED) & set(vars(fusedpc)), "a removed name is defined again"


def test_an_unknown_name_is_the_ordinary_attribute_error():
    with pytest.raises(AttributeError, match="^module 'fusedpc' has no attribute 'nonesuch'$"):
        fusedpc.nonesuch  # noqa: B018


@pytest.mark.parametrize("old", ["fusedpc.errors", "fusedpc.models", "fusedpc.data"])
def test_the_removed_modules_are_gone(old):
    assert not (PACKAGE / f"{old.rpartition('.')[2]}.py").exists()
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


# --------------------------------------------------------------------------- deprecation helper
def _release(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2])


def test_the_deprecation_helper_names_a_later_release():
    """A deprecation names the release that removes the old name, and it is a later one than
    this (Reliability III: 0.3.0 said "will be removed in 0.3")."""
    from fusedpc._deprecation import REMOVED_IN, warn_deprecated

    def old_spelling() -> None:
        warn_deprecated("old_spelling is now new_spelling")

    def caller() -> None:
        old_spelling()  # the line the warning names: the one after `def caller`

    assert _release(REMOVED_IN) > _release(fusedpc.__version__)
    with pytest.warns(DeprecationWarning) as caught:
        caller()
    assert [str(w.message) for w in caught] == [
        f"old_spelling is now new_spelling; the old name will be removed in {REMOVED_IN}."
    ]
    assert (caught[0].filename, caught[0].lineno) == (__file__, caller.__code__.co_firstlineno + 1)


# --------------------------------------------------------------------------- pyproject
def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _names(requirements: list[str]) -> set[str]:
    import re

    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def test_matplotlib_is_an_extra_and_the_test_extra_has_it():
    project = _pyproject()["project"]
    assert "matplotlib" not in _names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert "matplotlib" in _names(extras["cli"])
    assert "fusedpc[cli]" in extras["test"] or "matplotlib" in _names(extras["test"])


def test_py_typed_and_texts_are_package_data():
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["fusedpc"]
    assert (PACKAGE / "py.typed").is_file()


def test_every_dependency_has_a_floor():
    for requirement in _pyproject()["project"]["dependencies"]:
        assert ">=" in requirement, f"{requirement!r} has no floor"


# --------------------------------------------------------------------------- layers
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    base = PACKAGE.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imported(path: Path) -> list[tuple[int, str]]:
    return _imports_of(path.read_text(encoding="utf-8"), _module_name(path),
                       is_package=path.name == "__init__.py", filename=str(path))


def _imports_of(source: str, name: str, *, is_package: bool, filename: str = "<probe>"
                ) -> list[tuple[int, str]]:
    """(line, module) for every fusedpc module that module `name` imports, anywhere in it
    (inside functions too); relative imports resolved."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:  # `from fusedpc import core` imports fusedpc.core
                sub = f"{module}.{alias.name}"
                found.append((node.lineno, sub if _is_module(sub) else module))
    return sorted((line, m) for line, m in found if m == "fusedpc" or m.startswith("fusedpc."))


def _rank(module: str) -> float | None:
    """The layer of a fusedpc module; None for `BASE_MODULES` (below every layer)."""
    if module in BASE_MODULES:
        return None
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in FACADES:
        return FACADE_RANK
    return LAYERS[parts[1]]


def _violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        where = path.relative_to(ROOT)
        imports = _imported(path)
        if name in BASE_MODULES:
            found += [f"{where}:{line}: imports {m} (it may import nothing of fusedpc)"
                      for line, m in imports]
            continue
        rank = _rank(name)
        if rank == FACADE_RANK:
            continue  # the façades may import anything
        for line, module in imports:
            target = _rank(module)
            if target is not None and target > rank:
                found.append(f"{where}:{line}: {name} imports {module}, a layer above it")
    return found


def test_every_module_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        parts = name.split(".")
        assert (
            name in ("fusedpc", *BASE_MODULES)
            or (len(parts) >= 2 and (parts[1] in FACADES or parts[1] in LAYERS))
        ), f"{path.relative_to(ROOT)} is in no layer: add its folder to LAYERS here"


def test_no_module_imports_a_layer_above_it():
    violations = _violations()
    assert not violations, "layer rule broken:\n" + "\n".join(violations)


def test_the_layer_check_resolves_relative_and_function_level_imports():
    source = (
        "from . import _part\n"
        "from .. import parts\n"
        "import fusedpc._version\n"
        "def f():\n"
        "    from ..training import train\n"
        "    import fusedpc\n"
    )
    found = _imports_of(source, "fusedpc.core._probe", is_package=False)
    assert found == [(1, "fusedpc.core._part"), (2, "fusedpc.parts"), (3, "fusedpc._version"),
                     (5, "fusedpc.training"), (6, "fusedpc")]
    ranks = [_rank(m) for _, m in found]
    assert ranks == [0, 1, None, 4, FACADE_RANK]
