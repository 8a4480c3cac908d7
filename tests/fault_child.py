"""Child process of the fault-injection test: trains RECIPE with overrides, and SIGKILLs itself at a
random moment during its N-th checkpoint write (0: never). Usage:
  python fault_child.py N SEED RECIPE key=value ..."""

import os
import random
import signal
import sys
import threading
import time

from clis_train import checkpoint
from clis_train.config import load_config
from clis_train.train import Trainer

kill_at, seed, recipe, overrides = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
rng = random.Random(seed)
original_save = checkpoint.save
saves = 0


def save(*args, **kwargs):
  global saves
  saves += 1
  if saves != kill_at:
    return original_save(*args, **kwargs)
  threading.Timer(rng.uniform(0.0, 0.15), lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
  result = original_save(*args, **kwargs)
  time.sleep(5)  # the kill lands during the write, or just after it at the latest
  return result


checkpoint.save = save
Trainer(load_config(recipe, overrides)).run()
