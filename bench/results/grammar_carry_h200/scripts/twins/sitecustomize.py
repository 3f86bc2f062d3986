"""Experiment (not jspec): TWINS=1 gives a pipelined constrained step's forward part a second
loaded copy of its executable (serialized and loaded again: its own command buffers) and
alternates the two by launch: if the forward's temporaries alternate between two addresses,
each copy sees one of them and its graph is not re-recorded."""
import os
if os.environ.get("TWINS"):
    import itertools
    from jax.experimental import serialize_executable as se
    import jspec.runtime.split_step as ss
    from jspec.runtime.slim_part import SlimPart
    _init = ss.SplitExecutable.__init__

    def __init__(self, parts, bucket, sharding, **kw):
        _init(self, parts, bucket, sharding, **kw)
        f = self.forward
        if isinstance(f, SlimPart):
            c = f.compiled
            devices = list(sharding.mesh.devices.flat)
            copy = SlimPart(se.deserialize_and_load(*se.serialize(c), execution_devices=devices), f.plan)
            copies = itertools.cycle([f, copy])
            self.forward = lambda *a: next(copies)(*a)
            print(f"twins: bucket {bucket.batch_size} steps {bucket.draft_steps}", flush=True)

    ss.SplitExecutable.__init__ = __init__
