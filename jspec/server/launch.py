"""`jspec serve`: flags (the engine's as SGLang's launch_server spells them), the engine, uvicorn,
and a draining SIGTERM.

Start-up order: the engine first (loading and compiling take a while; a SIGTERM meanwhile just
ends the process, nothing is in flight), then the HTTP server. SIGTERM (or Ctrl-C) then drains:
`/health` and new generation requests answer 503, uvicorn stops accepting connections and waits
up to `--timeout-graceful-shutdown` seconds for the requests in flight to finish (past that it
cancels them, and each is aborted in the engine), then the engine shuts down and the process
exits 0.
"""

from __future__ import annotations

import logging
import signal
import sys

from jspec.errors import ConfigError
from jspec.runtime.gil import switch_interval

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_serve_parser(sub) -> None:
    from jspec.bench.cli import add_engine_flags, add_speculative_flags

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with SGLang's native endpoints")
    add_engine_flags(s)
    add_speculative_flags(s)
    s.add_argument("--disable-overlap-schedule", action="store_true")
    g = s.add_argument_group("server (as SGLang's launch_server)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--served-model-name", help="the model id clients see (default: --model-path)")
    g.add_argument("--random-seed", dest="seed", type=int, default=0,
                   help="seeds of requests that name none are drawn from it")
    g.add_argument("--stream-output", action="store_true",
                   help="/generate streams disjoint segments (text, ids and logprob lists) instead of all so far")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    g.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    s.set_defaults(func=run)


def validate(args) -> None:
    switch_interval()
    for flag in ("max_running_requests", "max_total_tokens", "context_length", "chunked_prefill_size", "page_size",
                 "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
        v = getattr(args, flag, None)
        if v is not None and v < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port must be in [0, 65536), got {args.port}")
    if args.timeout_graceful_shutdown < 0:
        raise ConfigError(f"--timeout-graceful-shutdown must be >= 0, got {args.timeout_graceful_shutdown}")
    knobs = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
             "speculative_simulate_accept_length", "speculative_draft_model_path")
    given = [k for k in knobs if getattr(args, k) is not None]
    if given and args.speculative_algorithm is None:
        raise ConfigError(f"--{given[0].replace('_', '-')} needs --speculative-algorithm")


def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, which also tells the app that a drain has begun (health -> 503)."""

        def __init__(self, config, bridge):
            super().__init__(config)
            self.bridge = bridge

        def handle_exit(self, sig, frame):
            self.bridge.draining = True
            super().handle_exit(sig, frame)

    return DrainingServer


def run(args) -> int:
    validate(args)
    try:
        import uvicorn
    except ImportError:
        print("jspec serve: needs the serve extra: pip install 'jspec[serve]'", file=sys.stderr)
        return 2
    from jspec.api import Engine
    from jspec.bench.serve import engine_kwargs, open_model, spec_kwargs, with_draft
    from jspec.server.app import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The engine loop and uvicorn's event loop share the GIL: hand it over sooner than Python's
    # default 5 ms (jspec.runtime.gil; measured: bench/README.md, "HTTP server").
    sys.setswitchinterval(switch_interval())
    kw = {**engine_kwargs(args), **spec_kwargs(args)}
    model = open_model(args)
    engine = Engine(model, **with_draft(kw, model, args))
    try:
        app = build_app(engine, served_model_name=args.served_model_name, stream_output=args.stream_output)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.timeout_graceful_shutdown)
        server = _server_class()(config, app.state.jspec.bridge)
        # uvicorn re-raises the signal it drained for once it is done, to the handler it found:
        # a no-op one, so the engine still shuts down below and the exit status is 0.
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            server.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        engine.shutdown()
    return 0
