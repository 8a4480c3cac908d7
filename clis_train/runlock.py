"""One trainer per run_dir: an exclusive `flock` on run_dir/.lock, held for the whole run.

The kernel drops a flock when its process dies (kill -9 included), so a lock left by a dead
trainer is never stale: the next run simply takes it. The file records who holds it, for the
message a second trainer prints.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import pathlib
import socket

from clis_train.errors import TrainingError


class RunLock:
  def __init__(self, run_dir: str | os.PathLike):
    self.path = pathlib.Path(run_dir) / ".lock"
    self.file = None

  def __enter__(self) -> "RunLock":
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.file = open(self.path, "a+")
    try:
      fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      self.file.seek(0)
      holder = self.file.read().strip() or "another process"
      self.file.close()
      raise TrainingError(f"run_dir={str(self.path.parent)!r} is in use by another trainer ({holder}); wait for it "
                          "to finish, or choose another run_dir") from None
    self.file.seek(0)
    self.file.truncate()
    self.file.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                    f"{datetime.datetime.now().isoformat(timespec='seconds')}\n")
    self.file.flush()
    return self

  def __exit__(self, *exc) -> None:
    fcntl.flock(self.file, fcntl.LOCK_UN)
    self.file.close()
