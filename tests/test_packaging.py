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
