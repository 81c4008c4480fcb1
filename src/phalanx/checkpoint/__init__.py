"""Flash checkpoint: shared-memory snapshots that block training only for a memory copy, a background
persister, storage backends and the commit protocol."""
