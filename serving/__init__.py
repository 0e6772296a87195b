"""Prediction serving: the model a job learns, scored over HTTP while it learns.

``streamrec serve`` answers the Open Inference Protocol (KServe v2) with the
job's own decoding, hashing and pooling (``serving.model``), rows from
serving replicas of the store shards (``embedding_store.replica``) and the
dense weights rank 0 publishes (``trainer.publish``).
"""
