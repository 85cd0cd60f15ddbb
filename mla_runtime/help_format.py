"""The ``--help`` format every subcommand shares (a leaf module: the planner imports it too)."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` shows each flag's default, except where there is none (required flags, None defaults:
    their help says what happens) or the help already names it; descriptions keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.required or action.default in (None, False, argparse.SUPPRESS) or "default:" in text:
            return text
        return super()._get_help_string(action)
