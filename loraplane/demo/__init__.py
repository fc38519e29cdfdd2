"""The embedded demo: a small model built locally, adapters, the whole system on one machine."""
