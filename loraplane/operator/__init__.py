"""loraplane.operator: not built yet (see the project's issues)."""
