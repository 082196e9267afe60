"""EAGLE-3 draft heads, draft-vocabulary maps and checkpoint formats."""
