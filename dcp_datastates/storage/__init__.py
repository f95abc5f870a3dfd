"""Where bytes go: :mod:`.fsspec_sink` (non-local URLs through fsspec), :mod:`.s3` (object-store
uploads and their bounds) and :mod:`.room` (disk space checks before a save)."""
