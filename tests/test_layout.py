"""The source's layout rules: no hidden channels (module-level mutable state, ContextVars,
jax's private modules) and modules of one concept (sizes), read off `src/` itself."""

from __future__ import annotations

import ast
import pathlib
import re

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "fusedpc"
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
CONTAINERS = {"list", "dict", "set", "defaultdict", "OrderedDict", "Counter", "deque",
              "WeakKeyDictionary", "WeakValueDictionary", "WeakSet"}
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update",
            "setdefault", "add", "discard"}


def _modules() -> list[pathlib.Path]:
    modules = sorted(SRC.rglob("*.py"))
    assert len(modules) > 50, "the layout test lost the source tree"
    return modules


def _mutated_globals(tree: ast.Module) -> set[str]:
    """Module-level names bound to a list, dict or set that the module changes in place (a
    mutating method, an item assignment or deletion, a `global` rebinding)."""
    containers = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
        value = getattr(node, "value", None)
        called = value.func if isinstance(value, ast.Call) else None
        name = called.id if isinstance(called, ast.Name) else (
            called.attr if isinstance(called, ast.Attribute) else None)
        mutable = isinstance(value, ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp
                             | ast.SetComp) or name in CONTAINERS
        if mutable:
            containers.update(t.id for t in targets if isinstance(t, ast.Name))
    changed, rebound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            rebound.update(node.names)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and node.func.attr in MUTATORS:
                changed.add(owner.id)
        if isinstance(node, ast.Assign | ast.Delete | ast.AugAssign):
            for target in getattr(node, "targets", [getattr(node, "target", None)]):
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                    changed.add(target.value.id)
    return (changed & containers) | rebound


def test_no_module_level_mutable_state_context_vars_or_private_jax():
    found = []
    for path in _modules():
        text = path.read_text()
        name = path.relative_to(SRC.parent)
        if re.search(r"\bContextVar\b|\bcontextvars\b", text):
            found.append(f"{name}: a ContextVar")
        if re.search(r"jax\._src\b", text):
            found.append(f"{name}: imports jax._src")
        for mutated in sorted(_mutated_globals(ast.parse(text))):
            found.append(f"{name}: module-level {mutated!r} is changed in place")
    assert not found, "\n".join(found)


def test_the_mutation_scan_finds_what_it_looks_for():
    # the scan above would pass on an empty rule: show it catches each kind
    stack = ast.parse("_STACK: list = []\ndef push(x):\n    _STACK.append(x)\n")
    table = ast.parse("_SEEN = {}\ndef see(k):\n    _SEEN[k] = 1\n")
    rebound = ast.parse("_COUNT = 0\ndef bump():\n    global _COUNT\n    _COUNT += 1\n")
    constant = ast.parse(
        "NAMES = ('a', 'b')\nTABLE = {'a': 1}\ndef read():\n    return TABLE['a']\n")
    assert _mutated_globals(stack) == {"_STACK"}
    assert _mutated_globals(table) == {"_SEEN"}
    assert "_COUNT" in _mutated_globals(rebound)
    assert _mutated_globals(constant) == set()
    cache = ast.parse("import weakref\n_MEMO = weakref.WeakKeyDictionary()\n"
                      "def get(k):\n    return _MEMO.setdefault(k, {})\n")
    assert _mutated_globals(cache) == {"_MEMO"}


def _named_exceptions() -> set[str]:
    """The modules and functions docs/architecture.md names as allowed to be larger (its
    section "Size exceptions", each as `path` or `path:function`)."""
    text = (DOCS / "architecture.md").read_text()
    match = re.search(r"## Size exceptions\n(.*?)(\n## |\Z)", text, re.DOTALL)
    return set(re.findall(r"`(src/fusedpc/[^`]+)`", match.group(1))) if match else set()


def test_modules_and_functions_stay_small_unless_the_guide_says_why():
    allowed = _named_exceptions()
    found = []
    for path in _modules():
        text = path.read_text()
        name = str(path.relative_to(SRC.parents[1]))
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES and name not in allowed:
            found.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and f"{name}:{node.name}" not in allowed:
                    found.append(f"{name}:{node.name}: {length} lines")
    assert not found, "over the limits, and not named in docs/architecture.md:\n" + "\n".join(
        found)
