"""One speculative cycle: draft -> tree -> verify -> accept -> commit, as pure tensor functions."""
