"""Errors that name what the user should change."""

from __future__ import annotations


class InvalidParam(ValueError):
    """Bad input: ``param`` names the request field or argument at fault (the HTTP error's ``param``), and the
    message says what is wrong with it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
