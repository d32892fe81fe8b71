"""`python -m embedctl` and the `embedctl` console script: the command line (embedctl.cli), loaded under a guard."""

import sys


def main() -> None:
    try:
        from embedctl.cli import main as run
    except KeyboardInterrupt:  # Ctrl-C while its libraries load (half a second): 130 and no traceback, as later
        sys.exit(130)
    run()


if __name__ == "__main__":
    main()
