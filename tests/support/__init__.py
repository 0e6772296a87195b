"""What the tests share, one module per kind of thing; fixtures stay in ``conftest.py`` files.

- :mod:`~tests.support.ports`: a free port, a port held so nothing else takes it.
- :mod:`~tests.support.waits`: waiting for a condition, with a deadline and a message.
- :mod:`~tests.support.processes`: ``streamrec`` commands, jobs, gloo ranks and Dask
  clusters started and stopped; the fast tier's check for unmarked processes.
- :mod:`~tests.support.jobs`: job files, and what tests wait for and check in a run.
- :mod:`~tests.support.kafka`: the brokers the Kafka fixtures start, topics, sources.
- :mod:`~tests.support.s3`: the S3 server the ``s3`` fixture starts.
- :mod:`~tests.support.bad_records`: bad JSON-lines records of every kind, and their spec.
"""
