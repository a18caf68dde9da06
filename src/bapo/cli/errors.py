"""User errors on the command line: one line naming the field and the fix, exit code 2, no
traceback; `bapo --debug ...` or BAPO_DEBUG=1 shows the traceback instead."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import NoReturn

import typer

DEBUG_ENV = "BAPO_DEBUG"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").lower() in ("1", "true", "yes", "on")


def refuse(message: str) -> NoReturn:
    """A user error as one line on stderr (`error: ...`, whitespace folded) and exit code 2."""
    typer.echo("error: " + " ".join(message.split()), err=True)
    raise typer.Exit(2)


@contextmanager
def user_errors():
    """Turn a ConfigError (a ValueError subclass that names the field and the fix) into one line."""
    from bapo.train import ConfigError

    try:
        yield
    except ConfigError as err:
        if debug_enabled():
            raise
        refuse(str(err))
