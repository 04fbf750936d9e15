"""``python -m lipvit ...``: the command line (also for ``torchrun -m lipvit``)."""

from lipvit.cli import main

main(prog_name="lipvit")
