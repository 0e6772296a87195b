"""Features, hashing, prepared batches and the Dask driver (StreamRunner)."""
