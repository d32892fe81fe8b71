"""`python -m embedctl`: the command line, as the `embedctl` script runs it."""

from embedctl.cli import main

main()
