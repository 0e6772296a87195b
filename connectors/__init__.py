"""Sources and sinks: Kafka, Parquet and synthetic streams, codecs, validation, dead letters."""
