"""The scripts in scripts/ share code through the package (`fusedpc.bench`'s private modules),
never by importing one another through `sys.path`."""

import ast
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_no_script_imports_another_or_touches_sys_path():
    names = {path.stem for path in SCRIPTS.glob("*.py")}
    assert {"bench", "gpu_check", "count_kernels"} <= names
    for path in sorted(SCRIPTS.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                imported = [(node.module or "").split(".")[0]]
            else:
                imported = []
            siblings = sorted(set(imported) & names)
            assert not siblings, (
                f"{path.name}:{node.lineno} imports the script {siblings[0]!r}; move what they "
                "share into fusedpc.bench (a private module)")
            if isinstance(node, ast.Attribute) and node.attr == "path":
                assert not (isinstance(node.value, ast.Name) and node.value.id == "sys"), (
                    f"{path.name}:{node.lineno} uses sys.path; import from the package instead")
