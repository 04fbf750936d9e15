"""The ``lipvit`` command line: a click group; its commands live in ``lipvit.commands``.

Commands are thin: parse options, build a config, call the library, write files.
User errors (``ValueError``, ``TypeError``, any ``OSError`` and
:class:`lipvit.errors.LipvitError`) become one line on stderr and exit code 1,
never a traceback. Click's own usage errors (an unknown option, a value of the
wrong type) exit 1 too: every error a user can cause exits 1.
"""

from __future__ import annotations

import click

from lipvit import __version__
from lipvit.allocator import is_lipvit_program, keep_freed_memory
from lipvit.errors import LipvitError

USER_ERRORS = (ValueError, TypeError, LipvitError)
USAGE_EXIT_CODE = 1


def _os_message(err: OSError) -> str:
    """``PATH: reason`` for an ``OSError`` (no errno, no traceback)."""
    reason = err.strerror or str(err)
    return f"{err.filename}: {reason}" if err.filename else reason


class _Group(click.Group):
    def make_context(self, *args, **kwargs) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as err:
            err.exit_code = USAGE_EXIT_CODE
            raise

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as err:
            err.exit_code = USAGE_EXIT_CODE
            raise
        except OSError as err:
            raise click.ClickException(_os_message(err)) from None
        except USER_ERRORS as err:
            raise click.ClickException(str(err)) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="lipvit")
def main() -> None:
    """Train Vision Transformers and certify their l2 robustness."""
    if is_lipvit_program():
        keep_freed_memory()


def _register() -> None:
    from lipvit.commands import COMMANDS

    for command in COMMANDS:
        main.add_command(command)


_register()
