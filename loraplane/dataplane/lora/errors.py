"""The LoRA manager's refusals that cross to the API server's process (a module without torch:
the server catches them from the engine's pipe without importing the engine)."""


class PinRefused(Exception):
    """A pin that would not fit: pinned adapters would take more than their cap of the
    adapter memory or of the slots. `str()` names the numbers."""
