"""Operator surfaces: admin API (backends, weights, reload), OpenAPI document, dashboard, compare CLI."""
