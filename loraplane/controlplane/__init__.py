"""The control plane: tenants, API keys, pools, adapter versions, audit and usage (FastAPI).

Start with `loraplane controlplane`; `main.create_app(settings)` builds the app. Never imports
`loraplane.dataplane`, so it runs from an install without torch (the `controlplane` extra).
See docs/controlplane.md.
"""
