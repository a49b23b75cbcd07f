"""A watchdog that stops a process group and removes its folders once its parent is gone.

``python -m pipeline.ray.reaper PARENT_PID PGID [FOLDER ...]``: a parent that starts a detached
process group (``ray start --head`` in its own session) cannot clean up after itself when it is
killed with SIGKILL. It starts this watchdog beside the group; the watchdog polls its parent's
pid and, once it has changed (the parent died and the watchdog was re-parented), stops the group
(SIGTERM, then SIGKILL) and removes the folders. A parent that ends normally stops the group
itself and then ends the watchdog.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main", "start_reaper", "stop_group"]

_POLL_S = 0.2


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a recycled id that is not ours: nothing of ours is left
        return False
    return True


def stop_group(pgid: int, grace_s: float, reap: subprocess.Popen[bytes] | None = None) -> None:
    """SIGTERM the group, SIGKILL what is left after ``grace_s``; ``reap``: its leader, if it
    is this process's child (waited for, so that the group can empty)."""
    for sig, grace in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _group_alive(pgid):
            if reap is not None:
                reap.poll()
            time.sleep(_POLL_S)
        if not _group_alive(pgid):
            break


def start_reaper(pgid: int, folders: Sequence[Path]) -> subprocess.Popen[bytes]:
    """Watch this process: when it dies, stop group ``pgid`` and remove ``folders``."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.ray.reaper", str(os.getpid()), str(pgid)]
        + [str(f) for f in folders],
        start_new_session=True,  # a Ctrl-C to the terminal's group is the parent's to handle
    )


def main(argv: Sequence[str] | None = None) -> int:
    parent, pgid, *folders = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the parent cleaned up itself
    while os.getppid() == int(parent):
        time.sleep(_POLL_S)
    stop_group(int(pgid), grace_s=2.0)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
