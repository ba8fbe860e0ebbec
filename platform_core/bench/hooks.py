"""Observe an object's method calls for the length of a ``with`` block.

The engine has no step callbacks, and the benchmarks must run ``LLM.generate`` exactly as users
do; so an instrument shadows one method on one instance with a timing wrapper and removes it on
exit. Nothing is changed at class level and nothing outlives the block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def observe_calls(obj: Any, name: str, on_return: Callable[[float, Any], None]) -> Iterator[None]:
    """Call ``on_return(seconds, result)`` after each ``obj.name(...)`` inside the block."""
    shadowed = name in vars(obj)
    original = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = original(*args, **kwargs)
        on_return(time.perf_counter() - start, result)
        return result

    setattr(obj, name, wrapper)
    try:
        yield
    finally:
        if shadowed:
            setattr(obj, name, original)
        else:
            delattr(obj, name)
