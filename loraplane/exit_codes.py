"""The `loraplane` command's exit codes, shared by its sub-commands (a leaf module: the tenant
CLI's commands and the top-level parser that dispatches to them need not import each other)."""

EXIT_OK, EXIT_REJECTED, EXIT_USAGE = 0, 1, 2
