"""loraplane.controlplane: not built yet (see the project's issues)."""
