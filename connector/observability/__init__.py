"""What the connector tells operators: records, vLLM metrics, spans, pool events, logs."""
