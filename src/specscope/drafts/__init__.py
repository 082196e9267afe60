"""Drafts shipped with specscope (see docs/training.md for how each was trained)."""
