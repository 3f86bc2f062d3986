"""Serving benchmarks for the in-process Engine, after SGLang's `bench_serving`.

datasets.py   workloads (sharegpt, random, generated-shared-prefix) as token-id requests
client.py     arrivals (all at once, Poisson rate, concurrency cap) and per-request timing
metrics.py    throughput and latency summary (SGLang's metric names)
record.py     the JSONL record (settings, device, JAX version, commit) and the printed table
serve.py      `jspec bench serve`: one engine, one workload, one record
sweep.py      `jspec bench sweep`: a grid of speculative settings x concurrency, speedup table
plot.py       `jspec bench plot`: PNG charts from the JSONL records
cli.py        the `jspec bench` argument parsers and flag validation
"""
