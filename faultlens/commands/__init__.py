"""The command layer: one module per ``faultlens`` subcommand, each ``add_parser`` and ``run``."""
