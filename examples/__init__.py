"""A package (not a namespace) so that examples.trl.tiny_task from the repository root wins over any
installed top-level `examples` (verl installs a `tests` package the same way)."""
