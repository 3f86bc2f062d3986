"""`jspec serve`: an OpenAI-compatible HTTP server with SGLang's native endpoints, over one `Engine`.

The `jspec.api.Engine` stays the one owner of the device; this package only translates HTTP into
engine calls and back. Modules, one responsibility each:

- `launch`: the `jspec serve` flags (SGLang's spelling), uvicorn, SIGTERM drain
- `app`: the FastAPI application (error handlers, middleware, routers)
- `openai_routes` / `native_routes`: `/v1/*` and SGLang's `/generate`, `/health`, ... endpoints
- `protocol`: pydantic models of the request bodies
- `openai_adapter`: OpenAI request -> engine sampling params; engine outputs -> OpenAI responses
- `engine_bridge`: engine calls bridged into asyncio (a thread per whole answer, streams on the event
  loop), abort on disconnect
- `stream_text`: the text of a streamed request, chunk by chunk, exactly as the engine's final text
- `chat_template`: the tokenizer's own chat template in a sandboxed Jinja2 environment
- `errors`: OpenAI-style error bodies naming the field at fault
- `metrics`: Prometheus counters, histograms and gauges

Nothing here is imported by the rest of jspec except `launch`, by `jspec.cli` (and `launch` imports
FastAPI and uvicorn only when the server starts), so the engine runs without the `serve` extra
installed.
"""
