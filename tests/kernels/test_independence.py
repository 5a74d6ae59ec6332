"""modelpar_kernels stands on its own: no kernel file imports the engine, so the package can ship without it."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _imported_modules(path: Path) -> list[str]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names (relative imports as ``.name``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def _is_engine(module: str) -> bool:
    return module == "modelpar" or module.startswith("modelpar.")


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_kernel_file_imports_nothing_from_modelpar(path):
    engine = [m for m in _imported_modules(path) if _is_engine(m)]
    assert not engine, f"kernels/{path.name} imports {engine}; take a process group (and callables) as arguments"


def test_importing_the_kernels_loads_no_engine_module():
    script = (
        "import sys, modelpar_kernels\n"
        "print(sorted(m for m in sys.modules if m == 'modelpar' or m.startswith('modelpar.')))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
