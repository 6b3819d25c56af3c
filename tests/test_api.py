"""Every public function and public method is fully annotated.

Public means reachable from the public namespaces below (their `__all__`, or else their
non-underscore attributes), plus the non-underscore methods and properties of the public
classes defined in fusedpc (inherited ones from fusedpc bases included). Every parameter but
`self`/`cls` carries an annotation (`*args` and `**kwargs` too: the type of each item), and so
does the return.
"""

import importlib
import inspect
import types
from collections.abc import Callable, Iterator

NAMESPACES = (
    "fusedpc",
    "fusedpc.core",
    "fusedpc.parts",
    "fusedpc.parts.learning",
    "fusedpc.transformer",
    "fusedpc.transformer.reference",
    "fusedpc.execution",
    "fusedpc.training",
    "fusedpc.training.data",
    "fusedpc.frozen",
    "fusedpc.losses",
    "fusedpc.transplant",
)

def _ours(obj: object) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "fusedpc"


def _public_names(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [name for name in vars(module) if not name.startswith("_")]
    return list(names)


def _callables() -> Iterator[tuple[str, Callable[..., object], bool]]:
    """Yields (qualified name, function, whether its first parameter is self or cls)."""
    seen: set[str] = set()
    for namespace in NAMESPACES:
        module = importlib.import_module(namespace)
        for name in _public_names(module):
            obj = getattr(module, name)
            if inspect.isfunction(obj) and _ours(obj):
                yield f"{obj.__module__}.{obj.__qualname__}", obj, False
            elif inspect.isclass(obj) and _ours(obj):
                for klass in obj.__mro__:
                    if not _ours(klass) or klass.__qualname__ in seen:
                        continue
                    seen.add(klass.__qualname__)
                    yield from _methods(klass)


def _methods(klass: type) -> Iterator[tuple[str, Callable[..., object], bool]]:
    for name, member in vars(klass).items():
        if name.startswith("_"):
            continue
        prefix = f"{klass.__module__}.{klass.__qualname__}.{name}"
        if isinstance(member, staticmethod):
            yield prefix, member.__func__, False
        elif isinstance(member, classmethod):
            yield prefix, member.__func__, True
        elif isinstance(member, property):
            if member.fget is not None and _ours(member.fget):
                yield prefix, member.fget, True
        elif inspect.isfunction(member) and _ours(member):
            yield prefix, member, True


def _missing(function: Callable[..., object], bound: bool) -> list[str]:
    signature = inspect.signature(function)
    params = list(signature.parameters.values())
    if bound and params:
        params = params[1:]
    missing = [p.name for p in params if p.annotation is inspect.Parameter.empty]
    if signature.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def test_public_callables_are_annotated() -> None:
    found = {qualname: _missing(fn, bound) for qualname, fn, bound in _callables()}
    assert len(found) > 50, "the walk found too few public callables; is it broken?"
    unannotated = {
        qualname: missing
        for qualname, missing in sorted(found.items())
        if missing
    }
    assert not unannotated, "public callables lacking annotations:\n" + "\n".join(
        f"  {qualname}: {', '.join(missing)}" for qualname, missing in unannotated.items()
    )
