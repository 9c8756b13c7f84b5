"""One module per CLI command, each with `run(cfg) -> int`."""
