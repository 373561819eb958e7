"""Storage layer: the one storage abstraction, entry naming, stored executables and the one ingest path."""
