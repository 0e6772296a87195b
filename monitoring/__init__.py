"""Watching a running job: the Dask dashboard page, Prometheus metrics, run reports."""
