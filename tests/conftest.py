"""Fixtures every test package may use."""

import gc
import importlib
import pathlib
import sys

import numpy as np
import pytest

from tests.helpers import TINY


def _installed_kernels_first() -> None:
    """pytest puts the repository root on ``sys.path`` (``tests`` is a package), where the top-level ``kernels/``
    folder (installed as ``modelpar_kernels``) would shadow Hugging Face's ``kernels`` package, which transformers
    (5.25 on) imports when installed. Import the installed one, if any, with the root out of the way, so that
    ``kernels`` names it for the session."""
    root = str(pathlib.Path(__file__).resolve().parents[1])
    kept = list(sys.path)
    sys.path[:] = [p for p in sys.path if p not in ("", ".", root)]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass  # not installed: nothing for the folder to shadow
    finally:
        sys.path[:] = kept


_installed_kernels_first()


def pytest_collection_finish(session) -> None:
    """What collection imported (torch, transformers, the engine) lives as long as the session: Python's own
    collections need not walk it again after each test's garbage."""
    gc.freeze()


def pytest_unconfigure(config) -> None:
    gc.unfreeze()  # an extension that counts its objects at exit (Triton's) would otherwise call them leaked


@pytest.fixture(scope="module")
def token_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, TINY.vocab_size, size=4000, dtype=np.uint16))
    return str(path)
