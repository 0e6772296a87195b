"""Generated gRPC stubs of the Open Inference Protocol (``embedding_store/proto/generate.py``)."""
