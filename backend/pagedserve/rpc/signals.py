"""Stop signals as an event, in a module that imports no torch: `pagedserve serve` installs them before
anything heavy is imported (torch takes seconds), so an orchestrator can stop it at any stage."""

from __future__ import annotations

import asyncio
import signal


def catch_stop_signals() -> asyncio.Event:
    """An event that SIGTERM and SIGINT set from now on, instead of ending the process: an orchestrator
    stops a server at any stage, one still loading its model too."""
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled.set)
    return signalled
