"""loraplane.dataplane: the OpenAI-compatible server and the engine behind it.

One base model on one device serves many tenants' LoRA adapters in mixed batches: `engine`
(continuous batching, `scheduler`, paged KV `block_manager`), `lora/` (rank-exact slots within
an adapter memory budget, optionally inside the KV cache; the tiers store -> disk -> host ->
device), `kernels/` (SGMV: Triton on CUDA, torch on CPU), `server/` (FastAPI, metrics, pressure
reports). Start it with `loraplane serve`; see docs/dataplane.md.
"""
