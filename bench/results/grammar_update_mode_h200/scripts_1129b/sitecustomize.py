# Throwaway probe: wall-clock spans of the engine loop's host phases (no profiler), dumped at exit.
import atexit, os, threading, time, json
try:
    if os.environ.get("TPROBE_LOG"):
        import jspec.runtime.engine_core  # noqa: F401
except ImportError:
    os.environ.pop("TPROBE_LOG")
if os.environ.get("TPROBE_LOG"):
    ev = []
    now = time.perf_counter

    def span(name, fn):
        def w(*a, **k):
            t = now()
            try:
                return fn(*a, **k)
            finally:
                ev.append((name, t, now(), threading.get_ident()))
        return w

    def patch(obj, attr, name):
        setattr(obj, attr, span(name, getattr(obj, attr)))

    from jspec.runtime import engine_core, scheduler, model_runner, split_step, grammar
    patch(engine_core.EngineCore, "step", "step")
    patch(engine_core.EngineCore, "_read_pending", "between")
    patch(engine_core.EngineCore, "_process", "process")
    patch(scheduler.Scheduler, "schedule", "schedule")
    patch(model_runner, "pack", "pack")
    model_runner.ModelRunner.fetch = staticmethod(span("fetch", model_runner.ModelRunner.fetch))
    patch(model_runner.ModelRunner, "dispatch", "dispatch")
    patch(split_step.SplitExecutable, "begin", "begin")
    patch(split_step.SplitExecutable, "complete", "complete")
    patch(split_step, "_launch", "fwd_launch")
    patch(grammar, "draft_inputs", "walk")
    orig_init = split_step.SplitExecutable.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        self.first = span("draft_call", self.first)
        self.second = span("verify_call", self.second)
        self.fused = span("fused_call", self.fused)
    split_step.SplitExecutable.__init__ = init

    @atexit.register
    def dump():
        if ev:
            with open(f"{os.environ['TPROBE_LOG']}.{os.getpid()}.json", "w") as f:
                json.dump(ev, f)
if os.environ.get("OLD_WALK"):
    try:
        import jspec.runtime.grammar as _g
        import oldgrammar as _o
        _g.draft_inputs = _o.draft_inputs
    except ImportError:
        pass
if os.environ.get("SYNC_FWD"):
    try:
        from concurrent.futures import Future as _F
        from jspec.runtime import split_step as _s
        _ob = _s.SplitExecutable.begin

        def _begin(self, *a):
            c = _ob(self, *a)
            if not self.plain and isinstance(c[0], _F):
                c[0].result()  # the forward's launch done before the loop reads the last step
            return c
        _s.SplitExecutable.begin = _begin
    except ImportError:
        pass
