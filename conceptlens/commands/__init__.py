"""One module per `conceptlens` subcommand: `add_arguments(parser)` and `run(args) -> int`."""
