"""Backend state and its lifecycle: the pool (health, outlier ejection, in-flight), health and load
polling, config generations and reload, live A/B split weights, discovered backends joining and
leaving (membership). May import routing/, client/, discovery/, `access.secrets` (a generation's
credentials) and tokenize/ (checking a config loads its tokenizers); never proxy/ or above: the
composition root hands a generation its service (`generations.Service`)."""
