"""Adapters that put CLiS attention into other training stacks (MaxText)."""
