"""`python -m bapo ...` is the `bapo` command."""

from bapo.cli.main import app

app(prog_name="bapo")
