"""Zero-downtime restart on SIGUSR2, the way gunicorn re-executes itself: the listening socket is handed over.

    old server ──SIGUSR2──► spawns `dflash2 serve <same arguments>` with the listening socket's descriptor
                            (DFLASH2_LISTEN_FD) and a pipe's write end (DFLASH2_READY_FD)
    new server: loads its engine before it accepts anything (app lifespan), then writes "r" on the pipe and
                accepts on the same socket (one queue: nothing queued is lost)
    old server: on "r", stops accepting, closes its idle connections, answers what it still has with
                `Connection: close` (clients come back on a new connection, to the new server), and exits 0 once
                those are done (--shutdown-timeout bounds it, as a drain). If the new server fails to start (the
                pipe ends without "r"), the old one says so and keeps serving.

The new server runs in a session of its own, so it outlives the old one.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from types import FrameType

logger = logging.getLogger("dflash2.server")

LISTEN_FD_ENV = "DFLASH2_LISTEN_FD"
READY_FD_ENV = "DFLASH2_READY_FD"
BACKLOG = 2048


def listening_socket(host: str, port: int) -> socket.socket:
    """The socket to serve on: the one handed over by the server being replaced, or a new one bound here."""
    inherited = os.environ.pop(LISTEN_FD_ENV, None)
    if inherited is not None:
        return socket.socket(fileno=int(inherited))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=BACKLOG)


def is_restart_child() -> bool:
    return READY_FD_ENV in os.environ


def announce_ready() -> None:
    """The new server is loaded: tell the old one (it stops accepting and drains)."""
    fd = int(os.environ.pop(READY_FD_ENV))
    try:
        os.write(fd, b"r")
    finally:
        os.close(fd)


def restart_command(argv: list[str]) -> list[str]:
    """This server's command line, to start its successor: `python -m dflash2.cli.main serve <its arguments>`."""
    arguments = argv[1:]
    if arguments[:1] == ["serve"]:
        arguments = arguments[1:]
    return [sys.executable, "-m", "dflash2.cli.main", "serve", *arguments]


class Restarter:
    """The SIGUSR2 handler: starts the successor and calls `on_ready` (from a thread) once it serves."""

    def __init__(self, command: list[str], sock: socket.socket, on_ready: Callable[[], None]) -> None:
        self.command = command
        self.sock = sock
        self.on_ready = on_ready
        self.in_progress = False

    def install(self) -> None:
        signal.signal(signal.SIGUSR2, self.handle)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.in_progress:
            logger.warning("SIGUSR2: a restart is already under way")
            return
        self.in_progress = True
        read_end, write_end = os.pipe()
        env = {**os.environ, LISTEN_FD_ENV: str(self.sock.fileno()), READY_FD_ENV: str(write_end)}
        try:
            child = subprocess.Popen(self.command, env=env, pass_fds=(self.sock.fileno(), write_end),
                                     start_new_session=True)
        except OSError as e:
            logger.error("SIGUSR2: could not start the new server (%s); this one keeps serving", e)
            os.close(read_end)
            self.in_progress = False
            return
        finally:
            os.close(write_end)
        logger.info("SIGUSR2: the new server (pid %d) is loading; this one serves until it is ready", child.pid)
        threading.Thread(target=self._wait_ready, args=(read_end, child), name="dflash2-restart", daemon=True).start()

    def _wait_ready(self, read_end: int, child: subprocess.Popen) -> None:
        with os.fdopen(read_end, "rb") as pipe:
            ready = pipe.read(1) == b"r"
        if ready:
            logger.info("the new server (pid %d) is ready: this one stops accepting and drains", child.pid)
            self.on_ready()
            return
        logger.error("the new server (pid %d) did not start (exit status %s); this one keeps serving", child.pid,
                     child.poll())
        self.in_progress = False
