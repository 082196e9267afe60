"""specscope tune: the best speculative configuration from a cost model and an acceptance model."""
