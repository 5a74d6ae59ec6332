"""Packaging: every package folder is shipped, and kernels/ imports under a collision-free name."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "modelpar").rglob("__init__.py")}
    found |= {
        "modelpar_kernels" + "".join("." + part for part in p.parent.relative_to(ROOT / "kernels").parts)
        for p in (ROOT / "kernels").rglob("__init__.py")
    }
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages"
    assert config["package-dir"]["modelpar_kernels"] == "kernels"


def test_kernels_import_from_the_top_level_folder():
    import modelpar_kernels

    assert pathlib.Path(modelpar_kernels.__file__).resolve().parent == ROOT / "kernels"


def test_an_installed_wheel_finds_its_recipes(tmp_path):
    """The wheel ships recipes/ as ``modelpar_recipes``: an install outside the checkout composes them."""
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("modelpar-*.whl")
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    probe = (
        "from hydra import compose, initialize_config_dir\n"
        "from modelpar.training.config import RECIPES, register_schema\n"
        "register_schema()\n"
        "with initialize_config_dir(config_dir=RECIPES, version_base='1.3'):\n"
        "    cfg = compose(config_name='train', overrides=['model=llama-1b'])\n"
        "print(RECIPES)\n"
        "print(cfg.model.name)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    recipes, name = out.stdout.split()
    assert recipes.startswith(str(target)) and name == "llama-1b"
