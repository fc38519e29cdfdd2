"""Confirmation for the commands that delete something or change what production serves.

On a terminal the command asks `... [y/N]` (on stderr, so `--json` output stays one document)
and goes on only for `y` or `yes`; `--yes` answers for it. Without a terminal on stdin and
without `--yes` it asks nothing and refuses before sending a request: a script must say
`--yes`, so a command pasted into one never deletes by surprise.
"""

from __future__ import annotations

import argparse
import sys

YES = ("y", "yes")


class NotConfirmed(Exception):
    """The change was not confirmed: nothing was changed (exit 1)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def add_flag(parser: argparse.ArgumentParser) -> None:
    """`--yes`: confirm without being asked (scripts; required when stdin is no terminal)."""
    parser.add_argument(
        "--yes",
        "-y",
        action="store_true",
        help="confirm without being asked (needed when stdin is not a terminal)",
    )


def require(args: argparse.Namespace) -> None:
    """Refuse at once when nobody can be asked and `--yes` was not given."""
    if not args.yes and not sys.stdin.isatty():
        raise NotConfirmed(
            "ConfirmationRequired",
            "this command needs confirmation and stdin is not a terminal, so nothing was "
            "asked and nothing changed: pass --yes to confirm",
        )


def ask(args: argparse.Namespace, question: str) -> None:
    """Ask `question [y/N]` on a terminal (unless `--yes`); NotConfirmed unless answered yes."""
    if args.yes:
        return
    require(args)
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline()
    if answer.strip().lower() not in YES:
        if not answer.endswith("\n"):
            sys.stderr.write("\n")  # end of input: keep the next line off the prompt's
        raise NotConfirmed("Cancelled", "not confirmed: nothing changed")
