"""CLI commands, one module each; ``COMMANDS`` is what ``lipvit.cli`` registers."""

from __future__ import annotations

import click

COMMANDS: list[click.Command] = []
