"""A small Wan-like video diffusion transformer, trained on synthetic bouncing shapes (issue 6's example)."""
