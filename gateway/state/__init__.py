"""Backend state and its lifecycle: the pool (health, outlier ejection, in-flight), health and load
polling, config generations and reload, live A/B split weights, discovered backends joining and
leaving (membership). May import routing/, client/ and discovery/."""
