"""Prometheus metrics families and the per-request Outcome that feeds them and the live statistics."""
