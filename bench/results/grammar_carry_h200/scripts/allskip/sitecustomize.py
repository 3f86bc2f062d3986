"""Experiment (not jspec): with JSPEC_GRAMMAR_UPDATE_MODE set (the VMM allocator), compile every
captured decode executable with that command-buffer update mode, the fused twins and plain decode
buckets included, not only the constrained split parts: is the unconstrained step's slowdown
under the VMM allocator its temporaries being allocated afresh each step?"""
import os
if os.environ.get("ALLSKIP"):
    import jspec.runtime.compile_options as co
    from jspec.models.batch import ForwardMode
    _orig = co.step_compiler_options

    def step_compiler_options(platform, bucket, drafting, part=0, tp=1):
        options = _orig(platform, bucket, drafting, part, tp)
        mode = co.grammar_update_mode()
        if (platform == "gpu" and mode and bucket.mode is ForwardMode.DECODE
                and options.get("xla_gpu_enable_command_buffer") != ""
                and "xla_gpu_command_buffer_update_mode" not in options):
            options["xla_gpu_command_buffer_update_mode"] = mode
            print(f"allskip: {bucket.batch_size} part {part} -> {mode}", flush=True)
        return options

    co.step_compiler_options = step_compiler_options
