"""Errors that cross component boundaries: a bad request names its field; an engine fault is internal."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request (or one of its parameters) is invalid. `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type[InvalidRequestError], tuple[str, str]]:
        return type(self), (self.field, self.message)  # pickled: from an engine process


class AdapterInUseError(InvalidRequestError):
    """A LoRA adapter cannot be unloaded while requests run (or wait) through it."""


class AdapterLoadedError(InvalidRequestError):
    """A LoRA adapter of that name is loaded already."""


class AdapterNotLoadedError(InvalidRequestError):
    """No LoRA adapter of that name is loaded (to unload)."""


class EngineDeadError(RuntimeError):
    """The engine can no longer run steps (a model fault or a dead worker); requests fail with this."""
