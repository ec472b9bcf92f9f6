"""One request's journey: parse, choose (routing), open with one retry loop, relay (SSE), and record
it exactly once (accounting); shadow traffic. May import routing/, state/, client/, observability/."""
