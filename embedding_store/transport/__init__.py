"""How ``StoreClient`` talks to one shard, one module per transport.

- ``base``: the ``ShardTransport`` protocol, ``RetryPolicy`` and ``id_array``;
- ``inproc``: a shard object in this process (``inproc://``);
- ``grpc``: a shard process over gRPC (``grpc://``), with ``status`` (gRPC status
  codes to the store's errors) and ``messages`` (protobuf replies to the store's types);
- ``shm``: the shared-memory area a gRPC transport passes frames through on one host.
"""
