"""`python -m loraplane.dataplane.server serve ...`: the server without the main CLI."""

from __future__ import annotations

import argparse
import sys

from loraplane.dataplane.server.cli import add_commands


def main() -> int:
    """Parse the command line and run the command."""
    parser = argparse.ArgumentParser(prog="python -m loraplane.dataplane.server")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args()
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
