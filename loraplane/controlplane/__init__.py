"""The control plane: tenants, API keys, pools, adapter versions, audit and usage (FastAPI).

Start with `loraplane controlplane`; `main.create_app(settings)` builds the app. Never imports
`loraplane.dataplane` (this image carries no torch). See docs/controlplane.md.
"""
