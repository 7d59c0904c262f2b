"""Children of ``fuseserve serve`` stop when it dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``).

Each child runs in a session of its own (a terminal's Ctrl-C reaches only the launcher, which stops
them in order), so nothing else ends them when the launcher is killed outright: they would keep the
ports, and the next ``fuseserve serve`` would fail on "address already in use". The launcher passes
its pid in ``$FUSESERVE_PARENT_PID``; ``follow_parent`` (first thing in ``fuseserve.cli.main``) asks
the kernel for SIGTERM when the parent goes, so the child drains and exits as on Ctrl-C.
``redis-server`` is started through ``following_argv``: a Python prelude that calls
``follow_parent`` too, then ``exec``s it (the request survives ``exec``).

The signal follows the THREAD that started the child: only the CLI launcher (whose main thread
starts and restarts every child) asks for it; ``fuseserve.serve()`` from Python does not.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_PID_ENV = "FUSESERVE_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

#: ``python -c`` prelude of ``following_argv``: argv[1] the parent's pid, argv[2:] the program
_PRELUDE = (
    "import os, sys\n"
    "from fuseserve.parent_death import PARENT_PID_ENV, follow_parent\n"
    "os.environ[PARENT_PID_ENV] = sys.argv[1]\n"
    "follow_parent()\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def supported() -> bool:
    return sys.platform.startswith("linux")


def follow_parent() -> None:
    """In a child started with ``$FUSESERVE_PARENT_PID``: SIGTERM when that parent dies (at once if it
    already has). The variable is removed, so this process's own children do not inherit it."""
    pid = os.environ.pop(PARENT_PID_ENV, None)
    if not pid or not supported():
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(pid):  # the parent died before the request: nobody will send it
        os.kill(os.getpid(), signal.SIGTERM)


def following_argv(argv: list[str]) -> list[str]:
    """``argv`` (a program and its arguments) run so that it gets SIGTERM when this process dies;
    ``argv`` unchanged where the platform has no such request."""
    if not supported():
        return argv
    return [sys.executable, "-c", _PRELUDE, str(os.getpid()), *argv]
