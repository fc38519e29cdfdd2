"""loraplane.planner: `loraplane plan`, the capacity planner.

From a base model's shape, a device and an adapter profile it works out what one replica holds
(`memory`: weights, KV cache, adapter memory under the engine's own `--lora-memory` rule, host and
disk tiers), how fast a replica steps (`cost`: a roofline for a GPU spec, or coefficients
measured on this engine by `calibrate`), and how many replicas a request rate needs for a p99
time-to-first-token target under three routing policies (`fleet`, `replica`, `routing`: a
discrete-event simulation of the replicas' continuous batching and adapter caches).

No torch here except in `calibrate` and `measure`, which run the real engine.
"""
