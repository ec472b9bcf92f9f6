"""The HTTP fronts: the native HTTP/1.1 front for the generation endpoints, aiohttp's server (with our
protocol) for everything else, their handlers and response sinks. May import proxy/, access/, state/,
observability/; nothing below imports this room."""
