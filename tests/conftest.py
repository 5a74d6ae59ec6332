"""Fixtures every test package may use."""

import numpy as np
import pytest

from tests.helpers import TINY


@pytest.fixture(scope="module")
def token_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, TINY.vocab_size, size=4000, dtype=np.uint16))
    return str(path)
