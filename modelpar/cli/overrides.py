"""Command-line overrides checked against the recipe schema before Hydra composes anything.

    modelpar-train +parallel.tpp=2
    modelpar-train: error: parallel.tpp is not a recipe key; did you mean parallel.tp?

Hydra refuses an unknown key in eight lines whose hint is to add it with ``+``, and then accepts the ``+``
form and ignores it (the schema's dataclasses have no such field). Both are refused here, in one line naming
the closest real key.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path

_INDEX = re.compile(r"\[[^\]]*\]")  # data.blend[0].path -> data.blend.path


def schema_keys(schema: type, prefix: str = "") -> Iterator[str]:
    """Every dotted key of ``schema`` (a dataclass), nested dataclasses included (``model.moe.experts``)."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        yield key
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from schema_keys(kind, key + ".")


def unknown_override(overrides: Sequence[str], schema: type, groups: Sequence[str]) -> str | None:
    """One line for the first override whose key is not in ``schema``, or None.

    ``overrides``: the command line (``parallel.tp=2``, ``+trainer.stepz=3``, ``model=tiny``, ``-m``);
    ``groups``: config-group names (``model``, ``parallel``, ...) whose ``group=choice`` Hydra checks itself.
    Keys under ``hydra`` and options (``-m``, ``--cfg job``) are Hydra's."""
    known = set(schema_keys(schema))
    for arg in overrides:
        if arg.startswith("-") or "=" not in arg:
            continue
        key = arg.split("=", 1)[0].lstrip("+~")
        if key.split(".")[0].split("/")[0] == "hydra" or key in groups:
            continue
        key = _INDEX.sub("", key)
        parts = key.split(".")
        # a key below a list or dict field (data.blend.path) belongs to that field's values
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in known:
                head = ".".join(parts[:end])
                break
        else:
            head = None
        if head == key or (head is not None and not _is_nested(schema, head)):
            continue
        # suggest a key at the typo's own depth (trainer.foo -> a trainer.* key, never the section trainer itself)
        section = key.rsplit(".", 1)[0] if "." in key else ""
        peers = sorted(k for k in known if k.count(".") == key.count(".") and (not section or k.startswith(section)))
        leaves = {k.rsplit(".", 1)[-1]: k for k in peers}  # compared by the last part: the section always matches
        close = [leaves[c] for c in difflib.get_close_matches(key.rsplit(".", 1)[-1], sorted(leaves), n=1, cutoff=0.6)]
        listing = f"the keys of {section} with --cfg job" if section in known else "the recipe's keys with --cfg job"
        hint = f"did you mean {close[0]}?" if close else f"see {listing}"
        return f"{key} is not a recipe key; {hint}"
    return None


def unknown_choice(overrides: Sequence[str], recipes: str, groups: Sequence[str]) -> str | None:
    """One line for the first ``group=choice`` naming no recipe of that group (``model=llama8b``), or None."""
    for arg in overrides:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key not in groups or not value:
            continue
        choices = sorted(p.stem for p in (Path(recipes) / key).glob("*.yaml"))
        for choice in value.split(","):  # a multirun sweep: model=tiny,llama-1b
            if choice.strip() and choice.strip() not in choices:
                close = difflib.get_close_matches(choice.strip(), choices, n=1, cutoff=0.5)
                hint = f"did you mean {key}={close[0]}? " if close else ""
                return f"{key}={choice.strip()} is not a {key} recipe; {hint}(one of {', '.join(choices)})"
    return None


def _is_nested(schema: type, key: str) -> bool:
    """Whether ``key`` names a dataclass (whose unknown sub-keys are typos), not a list or dict of values."""
    kind: typing.Any = schema
    for name in key.split("."):
        kind = typing.get_type_hints(kind)[name]
    return dataclasses.is_dataclass(kind)


def recipe_groups(recipes: str) -> tuple[str, ...]:
    """The config groups of a recipe directory: its subdirectories (``model``, ``parallel``, ...)."""
    return tuple(sorted(p.name for p in Path(recipes).iterdir() if p.is_dir() and not p.name.startswith("_")))


def refuse_unknown_overrides(prog: str, schema: type, recipes: str, argv: Sequence[str] | None = None) -> None:
    """Exit with one line (status 2) if the command line sets a key ``schema`` does not have."""
    argv = sys.argv[1:] if argv is None else argv
    groups = recipe_groups(recipes)
    problem = unknown_override(argv, schema, groups) or unknown_choice(argv, recipes, groups)
    if problem:
        print(f"{prog}: error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)
