"""The shared adapter core (safetensors and numpy only, never torch).

PEFT LoRA adapters from untrusted tenants are read defensively (`source`, `safetensors_io`),
validated against a base model's shapes and limits (`validate`), reduced to a canonical form
with a stable digest (`canonical`), and stored immutably and versioned (`ingest`, `store`).
"""
