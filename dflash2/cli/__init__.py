"""Command-line entry points (`dflash2 <command>`)."""
