"""The server's routes by domain, each module a `router(state)` for create_app to include:
completions.py (/v1/completions), chat.py (/v1/chat/completions), models.py (/v1/models),
tokenize.py (vLLM's /tokenize and /detokenize), probes.py (/health, /version, /metrics).

A route reaches the engine through `state.ready()` at each request, never at build time: the app
exists before the engine does, and a restart attaches a new one."""
