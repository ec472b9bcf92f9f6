"""Who may call what, how fast: client API keys, per-key rate limits, the admin token, secrets."""
