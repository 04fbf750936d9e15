"""The ``lipvit`` command line: a click group; its commands live in ``lipvit.commands``.

Commands are thin: parse options, build a config, call the library, write files.
User errors (``ValueError``, ``TypeError``, ``FileNotFoundError`` and
:class:`lipvit.errors.LipvitError`) become one line on stderr and exit code 1,
never a traceback.
"""

from __future__ import annotations

import click

from lipvit import __version__
from lipvit.errors import LipvitError

USER_ERRORS = (ValueError, TypeError, FileNotFoundError, LipvitError)


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except USER_ERRORS as err:
            raise click.ClickException(str(err)) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="lipvit")
def main() -> None:
    """Train Vision Transformers and certify their l2 robustness."""


def _register() -> None:
    from lipvit.commands import COMMANDS

    for command in COMMANDS:
        main.add_command(command)


_register()
