"""The models a server serves, by name, position or alias: :class:`ModelRegistry`."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator

from .loading import LoadedModel

DEFAULT_MODEL = "default"  # as a request's model: the first served model


class UnknownModelError(KeyError):
    """The requested model is not in the registry."""


class ModelRegistry:
    """The models a server serves, by name or position (the first is the default), and the
    aliases clients may use for them (agents ask for their own model names)."""

    def __init__(self, models: Iterable[LoadedModel] = (),
                 aliases: Iterable[tuple[str, str]] = ()) -> None:
        self._models: list[LoadedModel] = []
        self.aliases: list[tuple[str, str]] = []  # (name or glob, served name), first match wins
        for m in models:
            self.add(m)
        for pattern, served in aliases:
            self.alias(pattern, served)

    def alias(self, pattern: str, served: str) -> None:
        """Let requests for ``pattern`` (a name, or a glob such as ``claude-*``) reach the
        served model ``served``; ValueError when no such model is served."""
        if not any(m.name == served for m in self._models) and served != DEFAULT_MODEL:
            raise ValueError(f"--model-alias {pattern}={served}: no served model is named "
                             f"{served!r} (served: {', '.join(self.names())})")
        self.aliases.append((pattern, served))

    def add(self, model: LoadedModel) -> None:
        """Register a model; ValueError when its name is taken."""
        if any(m.name == model.name for m in self._models):
            raise ValueError(f"duplicate model name {model.name!r}")
        self._models.append(model)

    def remove(self, name: str) -> LoadedModel | None:
        """Stop serving ``name`` (a model loaded on demand, unloaded); None if not served."""
        for i, m in enumerate(self._models):
            if m.name == name:
                return self._models.pop(i)
        return None

    def get(self, name_or_index: str | int | None = None) -> LoadedModel:
        """None or ``"default"`` -> the first model; an int or digit string -> by position; else
        by name (a model actually named ``"default"`` wins over the first one)."""
        if not self._models:
            raise UnknownModelError("no models loaded")
        key = name_or_index
        if key is None:
            return self._models[0]
        if isinstance(key, str):
            for m in self._models:
                if m.name == key:
                    return m
            if key != DEFAULT_MODEL:
                for pattern, served in self.aliases:
                    if fnmatch.fnmatchcase(key, pattern):  # NOTE: served is a name or "default"
                        return self.get(served)
            if key == DEFAULT_MODEL:  # what many clients send when they have no name to give
                return self._models[0]
            if not key.isdecimal():
                raise UnknownModelError(f"unknown model {key!r}; have {self.names()}")
            key = int(key)
        if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(self._models):
            return self._models[key]
        raise UnknownModelError(f"unknown model {name_or_index!r}; have {self.names()}")

    def names(self) -> list[str]:
        """Model names in registration order."""
        return [m.name for m in self._models]

    def __len__(self) -> int:
        return len(self._models)

    def __iter__(self) -> Iterator[LoadedModel]:
        return iter(self._models)

    def __contains__(self, name: object) -> bool:
        return any(m.name == name for m in self._models)
