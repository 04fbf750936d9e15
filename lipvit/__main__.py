"""``python -m lipvit ...``: the ``lipvit`` command line (also for ``torchrun -m lipvit``)."""

from lipvit.cli import main

main(prog_name="lipvit")
