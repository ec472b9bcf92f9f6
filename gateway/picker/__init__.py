"""The Endpoint Picker: the gateway choosing backends for Envoy over Envoy's ext_proc protocol (GIE's
Endpoint Picker Protocol). `wire` reads and builds the messages (pure), `exchange` is one request's
journey (routing and accounting through `proxy`), `stream` the per-request ext_proc conversation,
`server` the gRPC server. May import proxy, routing, state, access and below; nothing imports it but
the composition root."""
