"""API schemas, separate from the tables: Create / Update bodies (unknown fields refused) and
Public answers (never a key's hash, never a storage path outside the internal API)."""
