"""``python -m dmsc``: the same as the ``dmsc`` command."""

from dmsc.cli import main

main()
