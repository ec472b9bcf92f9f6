"""The cheap upstream for overhead benchmarks: nginx config and canned vLLM bodies."""
