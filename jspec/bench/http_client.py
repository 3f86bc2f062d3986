"""`jspec bench serve --backend http`: a running `jspec serve` behind the slice of the `Engine` API
that the benchmark uses (`generate(..., stream=True)`, `get_server_info`, `wait_idle`, `tokenizer`,
`config.vocab_size`), so the same client threads, metrics and record measure the server, and the
HTTP cost is the difference between the two records.

Each request is one streamed POST to SGLang's `/generate` on its own connection (SGLang's
bench_serving opens one per request too); its server-sent events carry the output so far, and
`generate` turns them back into the engine's incremental chunks (new token ids, meta_info), so a
chunk's arrival time is taken where the in-process run takes it. Only the standard library is
used: a benchmark machine needs no HTTP client package.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import types
import urllib.parse

from jspec.bench.client import GENERATE_KEYS
from jspec.errors import ConfigError

TIMEOUT = 600.0  # seconds a connection may stay silent (a long prompt queued behind a full batch)


class HttpEngine:
    def __init__(self, base_url: str, tokenizer_path: str | None = None):
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(f"--base-url must be http(s)://host:port, got {base_url!r}")
        self._conn_class = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self._host, self._port = url.hostname, url.port
        self._prefix = url.path.rstrip("/")
        info = self._get("/get_model_info")
        self.model_path = info["model_path"]
        self.config = types.SimpleNamespace(vocab_size=int(info["vocab_size"]))
        # The workload's tokenizer: the local checkpoint named by --model-path, else the server's
        # own path when it is a folder on this machine too.
        self.tokenizer = None
        for path in (tokenizer_path, self.model_path):
            if path and os.path.isdir(str(path)):
                from jspec.models.loader import load_tokenizer

                self.tokenizer = load_tokenizer(str(path))
                break
        # Cumulative events (SGLang's default) or disjoint segments (the server's --stream-output).
        self._segments = bool(self.get_server_info().get("stream_output", False))

    def _connect(self):
        return self._conn_class(self._host, self._port, timeout=TIMEOUT)

    def _get(self, path: str) -> dict:
        conn = self._connect()
        try:
            conn.request("GET", self._prefix + path)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {resp.status}: {body[:500]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def get_server_info(self) -> dict:
        return self._get("/get_server_info")

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until the server has no request running or waiting."""
        end = time.time() + timeout
        while time.time() < end:
            info = self.get_server_info()
            if info["num_running_requests"] == 0 and info["num_waiting_requests"] == 0:
                return True
            time.sleep(0.05)
        return False

    def generate(self, input_ids, sampling_params=None, stream=True, **kwargs):
        """The engine's stream of incremental chunks ({"output_ids": new ids, "meta_info"}) of one
        request, read from the server's events. kwargs: the logprob fields of `client.GENERATE_KEYS`,
        which /generate takes beside the sampling parameters."""
        unknown = sorted(set(kwargs) - set(GENERATE_KEYS))
        if not stream or unknown:
            raise ValueError(f"HttpEngine serves the benchmark's streamed requests only (unknown: {unknown})")
        body = json.dumps({"input_ids": list(input_ids), "sampling_params": sampling_params or {}, "stream": True,
                           **kwargs})
        conn = self._connect()
        try:
            conn.request("POST", self._prefix + "/generate", body=body,
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"POST /generate: HTTP {resp.status}: {resp.read()[:500]!r}")
            seen = 0
            while True:
                line = resp.readline()
                if not line:
                    raise RuntimeError("POST /generate: the stream ended without [DONE]")
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"POST /generate: {event['error'].get('message')}")
                ids = event["output_ids"] if self._segments else event["output_ids"][seen:]
                seen += len(ids)
                yield {"text": event.get("text", ""), "output_ids": ids, "meta_info": event["meta_info"]}
        finally:
            conn.close()  # a request left early is aborted by the server when its connection closes
