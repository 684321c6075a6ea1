"""``python -m jacobian``: the ``jacobian`` command (``jacobian.cli.console``)."""

from jacobian.cli import console

console()
