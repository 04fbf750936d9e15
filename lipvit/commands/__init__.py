"""CLI commands, one module each; ``COMMANDS`` is what ``lipvit.cli`` registers."""

from __future__ import annotations

import click

from lipvit.commands.attack import attack
from lipvit.commands.certify import certify
from lipvit.commands.compare import compare
from lipvit.commands.export import export
from lipvit.commands.features import features
from lipvit.commands.info import info_command
from lipvit.commands.pipeline import pipeline
from lipvit.commands.plot import plot
from lipvit.commands.spectrum import spectrum
from lipvit.commands.tightness import tightness
from lipvit.commands.train import train_command

COMMANDS: list[click.Command] = [
    train_command,
    info_command,
    certify,
    attack,
    plot,
    features,
]
COMMANDS += [tightness, spectrum, pipeline]
COMMANDS += [compare]
COMMANDS += [export]
