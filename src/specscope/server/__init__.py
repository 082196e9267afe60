"""OpenAI-compatible HTTP server: schemas, the FastAPI app, Prometheus metrics."""

from specscope.server.app import create_app

__all__ = ["create_app"]
