"""Generated gRPC stubs of the embedding store service (see ``generate.py``)."""
