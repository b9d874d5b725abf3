"""Logging set-up shared by the commands and the server's engine process (which is spawned without them)."""
from __future__ import annotations

import logging


def configure_logging(log_level: str) -> None:
    logging.basicConfig(level=getattr(logging, str(log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
