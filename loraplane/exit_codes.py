"""The `loraplane` command's exit codes, shared by its sub-commands (a leaf module: the tenant
CLI's commands and the top-level parser that dispatches to them need not import each other)."""

EXIT_OK, EXIT_REJECTED, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it
