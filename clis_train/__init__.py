"""clis-train: MaxText-style training with CLiS attention (config, model, data, train loop, CLI, integrations)."""

__version__ = "0.1.0"
