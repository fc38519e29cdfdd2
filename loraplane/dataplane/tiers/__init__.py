"""Adapter tiers below the device pool: object store -> local disk -> host (CPU) memory.

`disk.DiskTier` turns a stored version (store path + digest) into a local folder; the host tier
(`lora.manager.LoRAManager`) reads it into memory, checking the digest while it copies, and
feeds the device pool. Loads run in the background so a cold adapter never stalls a step.
"""
