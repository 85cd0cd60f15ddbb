"""Errors that name what the user should change."""

from __future__ import annotations


class InvalidParam(ValueError):
    """Bad input: ``param`` names the request field or argument at fault (the HTTP error's ``param``), and the
    message says what is wrong with it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class InsufficientMemory(ValueError):
    """A model that cannot fit the memory it would load into: refused before any weight is read. The message gives
    the sizes and the settings that would fit; ``needed`` and ``available`` are the bytes."""

    def __init__(self, message: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available
