"""KV block identity and the Redis-backed block store shared by prefill and decode workers."""
