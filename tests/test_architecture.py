"""The package layout holds: every module imports on its own, and packages import only those below them.

    parallel <- model <- pipeline <- optim <- checkpoint, data <- training, plan <- bench <- cli

``plan`` (the analytical planner) sits beside ``training`` and imports nothing of it; ``bench`` (the benchmark
harness) sits above both. ``backends`` sits beside ``parallel`` (it may import it, and ``model``'s hooks;
``training`` and ``bench`` may import it), ``cli`` and ``modelpar.testing`` may import anything, the top-level
``modelpar`` only ``parallel``, and the kernels (``modelpar_kernels``) nothing of ``modelpar``. Only imports at
a module's top level count: an import inside a function is where a cycle hides, so the rule is checked on what
a reader sees first.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

LAYERS = ["parallel", "model", "pipeline", "optim", "checkpoint data", "training plan", "bench", "cli"]
EXTRA = {
    "modelpar.backends": {"modelpar.parallel", "modelpar.model"},
    "modelpar.training": {"modelpar.backends"},
    "modelpar.bench": {"modelpar.backends"},
    "modelpar": {"modelpar.parallel"},
}
ANYTHING = {"modelpar.cli", "modelpar.testing"}


def _module_name(path: pathlib.Path, top: pathlib.Path, package: str) -> str:
    parts = [package, *path.relative_to(top).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: str = "modelpar", top: pathlib.Path = ROOT / "modelpar") -> dict[str, pathlib.Path]:
    return {_module_name(p, top, package): p for p in sorted(top.rglob("*.py"))}


def _top_level_imports(path: pathlib.Path) -> list[str]:
    """Absolute modules named by the import statements at the top level of a file (``from a import b`` names
    ``a.b``, which is ``a`` itself when ``b`` is not a module)."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def _package(module: str) -> str:
    """The package a module belongs to for the layering rule: ``modelpar.<pkg>``, or ``modelpar`` itself."""
    return ".".join(module.split(".")[:2])


def _allowed(src: str, dst: str) -> bool:
    if src == dst or src in ANYTHING or dst in EXTRA.get(src, set()) or dst == "modelpar":  # the root: parallel's
        return True
    level = {f"modelpar.{name}": i for i, layer in enumerate(LAYERS) for name in layer.split()}
    return src in level and dst in level and level[dst] < level[src]


def _package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> package it imports -> the modules that do it."""
    modules = _modules()
    graph: dict[str, dict[str, list[str]]] = {}
    for module, path in modules.items():
        for name in _top_level_imports(path):
            if name != "modelpar" and not name.startswith("modelpar."):
                continue
            target = name if name in modules else name.rpartition(".")[0]
            graph.setdefault(_package(module), {}).setdefault(_package(target), []).append(module)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle of a directed graph once (as found by depth-first search), as the list of its nodes."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycle = path[path.index(node) :]
            if set(cycle) not in [set(c) for c in found]:
                found.append(cycle)
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


def test_packages_import_only_the_packages_below_them():
    wrong = [
        f"{src} imports {dst} (in {', '.join(sorted(set(where)))})"
        for src, targets in sorted(_package_graph().items())
        for dst, where in sorted(targets.items())
        if not _allowed(src, dst)
    ]
    assert not wrong, "imports against the package order:\n" + "\n".join(wrong)


def test_no_import_cycle_between_packages():
    graph = {src: {dst for dst in targets if dst != src} for src, targets in _package_graph().items()}
    assert not _cycles(graph), " | ".join(" -> ".join([*c, c[0]]) for c in _cycles(graph))


def test_no_import_cycle_between_modules():
    modules = _modules()
    graph = {
        module: {name if name in modules else name.rpartition(".")[0] for name in _top_level_imports(path)}
        & set(modules)
        for module, path in modules.items()
    }
    assert not _cycles(graph), " | ".join(" -> ".join([*c, c[0]]) for c in _cycles(graph))


def test_kernels_import_nothing_of_modelpar():
    kernels = _modules("modelpar_kernels", ROOT / "kernels")
    wrong = {
        module: name
        for module, path in kernels.items()
        for name in _top_level_imports(path)
        if name == "modelpar" or name.startswith("modelpar.")
    }
    assert not wrong, f"kernels import the engine: {wrong}"


# Each module in an interpreter of its own that has imported no modelpar module: numpy and torch (which every
# module pays for, and which import nothing of ours) are imported once and each module gets a fork of that
# process (by way of a fork that imported its package alone), as if by `python -c "import m"` for every one of
# them, without a torch import each; two at a time.
_IMPORT_EACH = textwrap.dedent(
    """
    import os, sys, traceback
    # third-party packages load once, before the forks: what is checked is that each of our modules imports
    # alone (no cycle, no missing import), and these cost seconds per fork otherwise
    import numpy, torch, sympy, hydra, omegaconf, torch.distributed.fsdp, torch.distributed.tensor
    if torch.version.cuda is None:  # as modelpar_kernels.grid sets it before triton loads on a CPU build
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton, triton.language
    # and every third-party module our modules pull in (torch._dynamo, pipelining, einops, safetensors, ...):
    # one fork imports all of ours and names the others it loaded, which this process then imports itself
    reader, writer = os.pipe()
    if os.fork() == 0:
        os.close(reader)
        for name in sys.argv[1:]:
            try:
                __import__(name)
            except BaseException:
                pass  # reported below, by the fork of its own
        others = [m for m in list(sys.modules) if not m.startswith(("modelpar", "__main__"))]
        os.write(writer, " ".join(others).encode())
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as pipe:
        third_party = pipe.read().split()
    os.wait()
    for name in third_party:
        if name not in sys.modules:
            try:
                __import__(name)
            except BaseException:
                pass  # a private or platform module that only loads as a side effect: the forks will load it
    # our sources compiled to bytecode once, into a folder of this run's (compiling is not importing: nothing
    # runs), so that no fork compiles them again where bytecode is not written (PYTHONDONTWRITEBYTECODE)
    import atexit, compileall, shutil, tempfile
    sys.pycache_prefix = tempfile.mkdtemp(prefix="import-each-")
    atexit.register(shutil.rmtree, sys.pycache_prefix, True)
    compileall.compile_dir("modelpar", quiet=2)
    # Importing a.b.c alone imports a, then a.b, then a.b.c: a fork of a process that imported the package a.b
    # alone is where a.b.c's own import begins. So each package is imported alone in a fork of this process,
    # and each module in it in a fork of that one, without importing the package again each time.
    names = sys.argv[1:]
    members = {n: [] for n in names if any(o.startswith(n + ".") for o in names)}
    for name in names:
        if name not in members:
            members.setdefault(name.rpartition(".")[0] if name.rpartition(".")[0] in members else "", []).append(name)
    failures, report = os.pipe()
    failed, running = [], {}
    for package in list(members) + [None] * 2:
        if len(running) == 2 or (package is None and running):  # two packages at a time, one per core
            pid, status = os.wait()
            if status:
                failed.append(running[pid])
            del running[pid]
        if package is None:
            continue
        pid = os.fork()
        if pid == 0:
            try:
                if package:
                    __import__(package)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            for name in members[package]:
                if os.fork() == 0:
                    try:
                        __import__(name)
                    except BaseException:
                        traceback.print_exc()
                        os._exit(1)
                    os._exit(0)
                if os.wait()[1]:
                    os.write(report, (name + " ").encode())
            os._exit(0)
        running[pid] = package
    os.close(report)
    with os.fdopen(failures) as pipe:
        failed += pipe.read().split()
    print("FAILED " + " ".join(sorted(failed)) if failed else "OK")
    """
)


def test_every_module_imports_on_its_own():
    names = sorted(_modules())
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, *names], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr


def test_no_test_module_imports_another():
    """Shared test code lives in conftest.py or a helpers module (not named ``test_*``), never in a test module:
    importing one runs its module-level set-up and ties two specifications together."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[-1].startswith("test_")]
    assert not found, "; ".join(found)


# -- CONTRIBUTING.md's import table is this rule --------------------------------------------------------------------


def _contributing_rows() -> list[tuple[list[str], str]]:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    table = text.split("<!-- import-table -->")[1].split("<!-- /import-table -->")[0]
    rows = []
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((re.findall(r"`(\w+)`", cells[0]), cells[2]))
    return rows


def test_the_layers_are_the_tables_rows_in_order():
    layered = {name for layer in LAYERS for name in layer.split()}
    rows = [" ".join(n for n in names if n in layered) for names, _ in _contributing_rows() if set(names) & layered]
    assert rows == LAYERS


def test_the_packages_that_may_import_the_backends_are_the_ones_the_table_says():
    said = set()
    for names, may_import in _contributing_rows():
        if "`backends`" in may_import and "backends" not in names:
            named = re.search(r"`backends` \(([\w, ]+)\)", may_import)
            said |= set(named.group(1).replace(",", " ").split()) if named else set(names)
    assert {f"modelpar.{n}" for n in said} == {p for p, allowed in EXTRA.items() if "modelpar.backends" in allowed}


def test_every_package_is_in_the_table():
    named = {n for names, _ in _contributing_rows() for n in names}
    packages = {p.parent.name for p in (ROOT / "modelpar").glob("*/__init__.py")}
    assert packages <= named
    assert {f"modelpar.{n}" for n in ("cli", "testing")} == ANYTHING
