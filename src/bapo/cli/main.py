"""`bapo` command line: one typer app; each command group lives in its own module and
registers itself, importing heavy libraries only inside the command body."""

import typer

from bapo.cli import demo_cmd, lab_cmd, train_cmd

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])
train_cmd.register(app)
demo_cmd.register(app)
lab_cmd.register(app)

if __name__ == "__main__":
    app()
