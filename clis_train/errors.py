"""The errors a user can act on: each message says what is wrong and what to do, and the CLI prints
it as one line (the traceback only with --debug or CLIS_TRAIN_DEBUG=1)."""

from __future__ import annotations


class UserError(Exception):
  """A bad config, input file, checkpoint or run state, named in the message."""


class ConfigError(UserError, ValueError):
  """A bad key or value in a YAML file or an override."""


class DataError(UserError, ValueError):
  """Training or eval data that cannot be read as configured."""


class CheckpointError(UserError, ValueError):
  """A checkpoint that cannot be used for this run."""


class TrainingError(UserError, RuntimeError):
  """Training stopped on purpose (non-finite loss, a second trainer on the run_dir, a full disk)."""


class Interrupted(UserError):
  """Ctrl-C or SIGTERM: the run stopped cleanly (the CLI exits 130)."""


class GracefulStop:
  """SIGINT/SIGTERM handling for the CLI. Inside the step loop the first signal only asks the loop to
  stop at the end of the current step (the step's input state is donated to it, so stopping in the
  middle could leave nothing whole to save); anywhere else, and on a second signal, it interrupts at
  once (KeyboardInterrupt)."""

  def __init__(self):
    self.in_loop = False
    self.requested = False

  def handler(self, signum, frame):
    if self.in_loop and not self.requested:
      self.requested = True
      return
    raise KeyboardInterrupt
