"""`dflash2 bench`: an async load generator against a running server, and its report."""
