"""Running streamrec: the ``streamrec`` command line, the job config schema, the job runner
(a rank's parts assembled, services started and checked, recovery), the local launchers
of store shards, Dask clusters and Kafka, and the Kubernetes manifests (``deploy/k8s``)."""
