"""A registry of parser classes by name, extensible through an entry-point group.

Shared by the reasoning parsers and the tool-call parsers: built-ins register in code with the
:meth:`ParserRegistry.register` decorator; third-party distributions declare an entry point in
the registry's group whose object is a subclass of the registry's base class. Entry points are
loaded once, the first time a name is looked up that code did not register, or all names are
listed. A broken entry point is logged and skipped, and looking it up names the failure.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

from platform_core.errors import ConfigError

logger = logging.getLogger("platform_core.plugins")

P = TypeVar("P")


class UnknownParserError(ConfigError):
    """A parser name that no built-in and no installed entry point provides."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        super().__init__(f"unknown {kind} {name!r}; known: {', '.join(known) or 'none'}")
        self.kind = kind
        self.name = name
        self.known = known


class ParserRegistry(Generic[P]):
    """Parser classes of one kind (``kind`` names it in errors), each a subclass of ``base``."""

    def __init__(self, kind: str, base: type[P], group: str) -> None:
        self.kind = kind
        self.base = base
        self.group = group
        self._classes: dict[str, type[P]] = {}
        self._broken: dict[str, str] = {}
        self._plugins_loaded = False

    def register(self, name: str) -> Callable[[type[P]], type[P]]:
        """Class decorator registering a parser under ``name``; a name is registered once."""

        def add(cls: type[P]) -> type[P]:
            if self._classes.get(name, cls) is not cls:
                raise ConfigError(f"{self.kind} {name!r} is already registered")
            self._check(cls)
            self._classes[name] = cls
            return cls

        return add

    def get(self, name: str) -> type[P]:
        """The parser class registered as ``name``."""
        if name not in self._classes:
            self._load_plugins()
        if name in self._broken:
            raise ConfigError(f"{self.kind} {name!r} failed to load: {self._broken[name]}")
        if name not in self._classes:
            raise UnknownParserError(self.kind, name, self.names())
        return self._classes[name]

    def names(self) -> list[str]:
        """The names of every usable parser, built-in and installed, sorted."""
        self._load_plugins()
        return sorted(self._classes)

    def _check(self, cls: object) -> None:
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise ConfigError(f"{cls!r} is not a {self.base.__name__} subclass")

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for ep in importlib.metadata.entry_points(group=self.group):
            try:
                cls = ep.load()
                self._check(cls)
            except Exception as exc:
                logger.warning("%s plugin %r failed to load: %r", self.kind, ep.name, exc)
                self._broken[ep.name] = f"entry point {ep.value!r}: {exc!r}"
                continue
            # A plugin module may also register itself with the decorator; that is the same class.
            if self._classes.setdefault(ep.name, cls) is not cls:
                logger.warning(
                    "%s plugin %r (%s) ignored: the name is taken", self.kind, ep.name, ep.value
                )
