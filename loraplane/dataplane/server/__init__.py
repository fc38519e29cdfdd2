"""The data plane's HTTP server: OpenAI-compatible API, adapter admin, metrics, pressure.

Modules: settings (flags and LORAPLANE_* env), app (FastAPI app and life cycle), runtime (the
engine thread, adapter leases), openai_routes / openai_format / generation (completions),
admin_routes (health, ready, metrics, load/unload), protocol (request bodies), errors (one error
map), catalog / catalog_http (tenants and model names), limits (rate limits), metrics
(Prometheus), pressure (reports to the control plane), serving / cli (`loraplane serve`).
"""
