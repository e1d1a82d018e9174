"""The server's threads named in the operating system as they are in Python."""

from __future__ import annotations

import ctypes
import sys
import threading

_PR_SET_NAME = 15  # prctl(2)
_MAX_NAME_BYTES = 15  # Linux keeps 15 bytes of a thread's name


def name_os_thread() -> None:
    """Give the calling thread's OS thread its Python name ("pagedserve-torch_0" shows as
    "pagedserve-torc"), as Python 3.14 does for every thread: `top -H`, `ps -L`, perf and
    /proc/PID/task/TID/comm then say which thread is the engine's, and bench/serving.py's
    --engine-cores finds it there. Threads it starts take the name too (libgomp's workers of the torch
    thread). Linux only; nothing elsewhere. An initializer of the server's thread pools."""
    if not sys.platform.startswith("linux"):
        return
    name = threading.current_thread().name.encode()[:_MAX_NAME_BYTES]
    ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
