"""Host-side accounting of device memory: KV pages and request slots."""
