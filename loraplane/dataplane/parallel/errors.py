"""The tensor-parallel group's failure, in a module without torch: the engine loop catches it,
and the API server's process may read it from the engine's pipe (comm.py raises it)."""


class WorkerLost(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the replica cannot step again (its
    engine gives up and reports not ready; a restart brings the group back)."""
