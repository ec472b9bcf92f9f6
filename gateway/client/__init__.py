"""The upstream HTTP client of the request path: pooled keep-alive connections to backends.
Imports nothing from the rest of the gateway."""
