"""One module per supported plugin, each exporting `setup(directive, ctx) -> Plugin`."""
