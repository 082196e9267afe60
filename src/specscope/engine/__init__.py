"""Requests, the model runner and the LLM front door (the only stateful orchestrator)."""
