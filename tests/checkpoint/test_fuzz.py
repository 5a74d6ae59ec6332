"""Hostile checkpoints and token files: every one is refused in one line, never with a traceback, and nothing
outside the checkpoint is ever opened.

Each example copies a small real checkpoint (or token file), damages it the way a failing disk or an
attacker who can write the directory would (flipped bytes, truncation, an edited ``index.json`` with huge
shapes, paths out of the directory, wrong types, tensors of the wrong dtype), then loads it as training
does. Anything but success or a one-line ``CheckpointError`` / ``DataError`` fails the test.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from modelpar.checkpoint.save import save_checkpoint
from modelpar.checkpoint.store import CheckpointError, Piece, load_pieces, read_index, sha256_file
from modelpar.data import DataError, TokenFile

SHAPES = {"embed.weight": (16, 8), "layers.0.mlp.weight": (8, 8), "norm.weight": (8,)}
FUZZ = settings(
    max_examples=500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# every file Python opens while a hostile checkpoint is loaded (an audit hook cannot be removed: it is gated);
# safetensors opens files natively, and only names the index check accepted (plain names inside the checkpoint)
_opened: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], str | bytes | Path):
        _opened.append(str(args[0]))


sys.addaudithook(_audit)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A real checkpoint (model pieces in two files, optimizer pieces, rank state) beside a secret file."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "outside").mkdir()
    save_file({"secret": torch.ones(4)}, str(root / "outside" / "secret.safetensors"))
    pieces = {}
    for name, shape in SHAPES.items():
        full = torch.randn(shape)
        if len(shape) == 2:
            half = shape[0] // 2
            pieces[Piece(name, shape, ((0, half), (0, shape[1])))] = full[:half]
            pieces[Piece(name, shape, ((half, shape[0]), (0, shape[1])))] = full[half:]
        else:
            pieces[Piece.whole(name, shape)] = full
    moments = {Piece.whole(f"exp_avg/{n}", s): torch.zeros(s) for n, s in SHAPES.items()}
    meta = {"layout": {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}, "sampler": {"epoch": 0, "position": 3}, "model": {}}
    ckpt = save_checkpoint(root / "ckpts", 4, pieces, {"rng": torch.zeros(8)}, meta, optimizer=moments)
    return root, ckpt


def load_like_training(ckpt: Path) -> None:
    index = read_index(ckpt, verify=True)
    wanted = [Piece.whole(name, shape) for name, shape in SHAPES.items()]
    load_pieces(ckpt, index, wanted)
    load_pieces(ckpt, index, [Piece.whole(f"exp_avg/{n}", s) for n, s in SHAPES.items()], "optimizer_tensors")


def _refused_cleanly(ckpt: Path, outside: Path) -> str | None:
    """Load ``ckpt``; None on success, the message on a clean refusal; anything else propagates."""
    global _opened
    _opened = []
    try:
        load_like_training(ckpt)
        return None
    except CheckpointError as exc:
        message = str(exc)
        assert "\n" not in message and message, repr(message)
        return message
    finally:
        opened, _opened = _opened, None
        strays = [p for p in opened if Path(p).resolve().is_relative_to(outside.resolve())]
        assert not strays, f"a file outside the checkpoint was opened: {strays}"


HOSTILE = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 0, 1, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        ["../outside/secret.safetensors", "/etc/passwd", "..", "model-00000.safetensors", "a/b.safetensors"]
    ),
    st.none(),
    st.booleans(),
    st.lists(st.integers(-5, 2**40), max_size=4),
    st.just({}),
    st.just([[0, 10**12]]),
)


def _paths(value, prefix=()):
    """Every (path, value) in a JSON document."""
    yield prefix, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


def _set(doc, path, value):
    if not path:
        return value
    node = doc
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return doc


@st.composite
def index_edits(draw, index: dict):
    """An edited index: some field replaced with a hostile value, a key renamed, or an entry deleted."""
    doc = copy.deepcopy(index)
    paths = [p for p, _ in _paths(doc) if p]
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p, _ in _paths(doc) if p]
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "replace", "delete", "rename"]))
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        if action == "replace":
            doc = _set(doc, path, draw(HOSTILE))
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            new = draw(st.sampled_from(["../outside/secret.safetensors", "/tmp/x.safetensors", "", "x"]))
            parent[new] = parent.pop(path[-1])
    return doc


@given(data=st.data())
@FUZZ
def test_hostile_checkpoints_are_refused_in_one_line(sandbox, data):
    root, base = sandbox
    with tempfile.TemporaryDirectory(dir=root) as work:
        ckpt = Path(work) / base.name
        shutil.copytree(base, ckpt)
        files = sorted(p for p in ckpt.iterdir() if p.is_file())
        kind = data.draw(st.sampled_from(["flip", "truncate", "index", "index", "dtype"]))
        if kind == "flip":
            target = data.draw(st.sampled_from(files))
            raw = bytearray(target.read_bytes())
            at = data.draw(st.integers(0, len(raw) - 1))
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
            target.write_bytes(bytes(raw))
        elif kind == "truncate":
            target = data.draw(st.sampled_from(files))
            raw = target.read_bytes()
            target.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1))])
        elif kind == "index":
            index = json.loads((ckpt / "index.json").read_text())
            edited = data.draw(index_edits(index))
            (ckpt / "index.json").write_text(json.dumps(edited))
        else:  # a model file rewritten with integer tensors, its hash updated in the index
            index = json.loads((ckpt / "index.json").read_text())
            name = "model-00000.safetensors"
            keys = [p["key"] for t in index["tensors"].values() for p in t["pieces"]]
            save_file({k: torch.zeros(SHAPES[k.split("@")[0]], dtype=torch.int32)[:8] for k in keys}, str(ckpt / name))
            index["files"][name] = {"sha256": sha256_file(ckpt / name), "bytes": (ckpt / name).stat().st_size}
            (ckpt / "index.json").write_text(json.dumps(index))
        message = _refused_cleanly(ckpt, root / "outside")
        # without a key an edited index.json can only be checked for sense; damaged data files are always caught
        if kind in ("truncate", "dtype") or (kind == "flip" and target.suffix == ".safetensors"):
            assert message is not None, f"a damaged checkpoint ({kind}) was loaded"


def test_a_path_out_of_the_checkpoint_is_refused_without_opening_it(sandbox, tmp_path):
    root, base = sandbox
    ckpt = tmp_path / base.name
    shutil.copytree(base, ckpt)
    index = json.loads((ckpt / "index.json").read_text())
    secret = root / "outside" / "secret.safetensors"
    index["files"]["../../outside/secret.safetensors"] = {"sha256": sha256_file(secret), "bytes": secret.stat().st_size}
    (ckpt / "index.json").write_text(json.dumps(index))
    message = _refused_cleanly(ckpt, root / "outside")
    assert message and "only plain NAME.safetensors files" in message, message


def test_a_huge_shape_is_refused_before_any_allocation(sandbox, tmp_path):
    _, base = sandbox
    ckpt = tmp_path / base.name
    shutil.copytree(base, ckpt)
    index = json.loads((ckpt / "index.json").read_text())
    index["tensors"]["norm.weight"]["global_shape"] = [2**40]
    (ckpt / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"tensors\['norm.weight'\]: its pieces hold 8 of its 1099511627776"):
        read_index(ckpt)


# -- token files ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 100, size=600, dtype=np.uint16))
    return path


HEADER_EDITS = [
    (b"'<u2'", b"'|O'"),
    (b"'<u2'", b"'<f4'"),
    (b"'<u2'", b"'<i8'"),
    (b"'<u2'", b"'>u2'"),
    (b"'<u2'", b"'<u4'"),
    (b"False", b"True"),
    (b"(600,)", b"(10000000000000,)"),
    (b"(600,)", b"(30, 20)"),
    (b"(600,)", b"(-5,)"),
    (b"(600,)", b"()"),
    (b"'descr'", b"'dtype'"),
]


@given(data=st.data())
@settings(
    max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_hostile_token_files_are_refused_in_one_line(token_file, data):
    raw = bytearray(token_file.read_bytes())
    kind = data.draw(st.sampled_from(["flip", "truncate", "header", "random", "ids"]))
    if kind == "flip":
        at = data.draw(st.integers(0, 127))  # the header: the data bytes are ids, any value is an id
        raw[at] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "header":
        old, new = data.draw(st.sampled_from(HEADER_EDITS))
        raw = bytearray(bytes(raw).replace(old, new, 1))
    elif kind == "random":
        raw = bytearray(data.draw(st.binary(max_size=300)))
    else:  # an id beyond the vocabulary
        at = 128 + 2 * data.draw(st.integers(0, 599))
        raw[at : at + 2] = np.uint16(data.draw(st.integers(100, 65535))).tobytes()
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "tokens.npy"
        path.write_bytes(bytes(raw))
        try:
            tokens = TokenFile.open(path, 100, 16)
            tokens.batch(np.arange(tokens.num_windows))
        except DataError as exc:
            assert "\n" not in str(exc) and str(exc)
            return
    assert kind in ("flip", "truncate"), f"a hostile token file ({kind}) was accepted"
