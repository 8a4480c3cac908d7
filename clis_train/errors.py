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
