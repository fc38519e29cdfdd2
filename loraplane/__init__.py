"""loraplane: many tenants' LoRA fine-tunes of one base model, served from one GPU."""

__version__ = "0.1.0"
