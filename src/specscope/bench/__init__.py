"""Workloads and benchmark clients."""
