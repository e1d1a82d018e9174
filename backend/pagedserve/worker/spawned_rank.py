"""A spawned tensor-parallel rank's entry point, `python -m pagedserve.worker.spawned_rank PID` (PID:
the process that started it, rank 0). It watches that process from its first line, before it
imports torch (seconds) and waits at the rendezvous: a rank 0 killed meanwhile (an OOM kill, a
SIGKILL) used to leave the rank waiting out the start-up timeout (30 minutes), holding its memory
and, on a GPU host, its device. Once the ranks have met, rank 0's sockets closing stops them too."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

PARENT_POLL_S = 0.5


def exit_with_parent(parent: int) -> None:
    """Exit (status 1) as soon as process `parent` has gone: this process is then someone else's
    child (init's, or a subreaper's), which a daemon thread checks every PARENT_POLL_S seconds."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        # (through logging: a JSON line under --log-format json once the rank has configured it)
        logging.getLogger(__name__).error(
            "tensor-parallel rank: its rank 0 (pid %d) has gone; exiting", parent
        )
        os._exit(1)

    threading.Thread(target=watch, name="pagedserve-rank-0-watch", daemon=True).start()


if __name__ == "__main__":
    exit_with_parent(int(sys.argv[1]))
    from pagedserve.worker.multiproc_executor import spawned_rank_main

    sys.exit(spawned_rank_main())
