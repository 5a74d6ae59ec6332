"""One search's memo: the planner's pieces that depend on fewer inputs than a whole strategy (a stage's chunk
bytes, a micro-batch's FLOPs, a stage's parameters, ...) are kept by what they read while ``search_memo`` is open,
and dropped when it closes, so memory stays bounded by one search. Outside it every call computes afresh.

A key names a model and a hardware by identity (``id``): both must stay alive and unchanged while the memo is
open (``modelpar.plan.search.plan`` holds them for its whole search)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")

_MEMO: contextvars.ContextVar[dict | None] = contextvars.ContextVar("plan_search_memo", default=None)


@contextlib.contextmanager
def search_memo():
    """Inside, ``per_search`` functions keep their answers (nested opens share the outer memo)."""
    if _MEMO.get() is not None:
        yield
        return
    token = _MEMO.set({})
    try:
        yield
    finally:
        _MEMO.reset(token)


def current() -> dict | None:
    """The open memo, or None outside ``search_memo``."""
    return _MEMO.get()


def per_search(key: Callable[..., Hashable]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Keep ``fn``'s answers inside ``search_memo`` by ``key(*args, **kwargs)``: every input the answer reads,
    nothing more (an answer must be immutable: callers share it)."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def inner(*args, **kwargs) -> T:
            memo = _MEMO.get()
            if memo is None:
                return fn(*args, **kwargs)
            k = (fn, key(*args, **kwargs))
            found = memo.get(k, _MISSING)
            if found is _MISSING:
                found = memo[k] = fn(*args, **kwargs)
            return found

        return inner

    return wrap


_MISSING = object()


class Bounded(dict):
    """A process-wide cache that forgets its oldest entry past ``limit``: the planner's pieces that outlive one
    search (a partition, a piece's bytes) stay bounded in a process that runs search after search (a notebook,
    a service, the test suite)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value) -> None:
        if key not in self and len(self) >= self.limit:
            del self[next(iter(self))]  # insertion order: the oldest
        super().__setitem__(key, value)
