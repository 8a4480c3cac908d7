"""clis-train: MaxText-style training with CLiS attention (the trainer lands with the training-library issue)."""

__version__ = "0.1.0"
