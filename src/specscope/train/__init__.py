"""EAGLE-3 draft training: data, regeneration, training-time test, checkpoints, export."""
