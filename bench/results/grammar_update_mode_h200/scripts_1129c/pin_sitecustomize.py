"""Probe: pin named threads to CPUs (PROBE_PIN="prefix=cpu,..." by thread-name prefix) and sample
every thread's CPU and CPU time once a second into PROBE_THREADS (a file)."""
import os
import threading
import time

_pins = [tuple(p.split("=")) for p in os.environ.get("PROBE_PIN", "").split(",") if "=" in p]
_run = threading.Thread.run


def _pinned_run(self):
    for prefix, cpu in _pins:
        if self.name.startswith(prefix):
            os.sched_setaffinity(0, {int(cpu)})  # Linux: pid 0 is the calling thread
    return _run(self)


if _pins:
    threading.Thread.run = _pinned_run

_path = os.environ.get("PROBE_THREADS")


def _sample():
    with open(_path, "w") as f:
        while True:
            time.sleep(1.0)
            rows = []
            names = {t.native_id: t.name for t in threading.enumerate()}
            for tid in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{tid}/stat") as s:
                        stat = s.read()
                except OSError:
                    continue
                name = names.get(int(tid), stat[stat.index("(") + 1: stat.rindex(")")]).replace(" ", "_")
                fields = stat[stat.rindex(")") + 2:].split()
                # fields[0] is stat's 3rd field: utime 14th, stime 15th, processor 39th
                rows.append(f"{tid}:{name}:{fields[36]}:{int(fields[11]) + int(fields[12])}")
            f.write(f"{time.time():.1f} " + " ".join(rows) + "\n")
            f.flush()


if _path:
    threading.Thread(target=_sample, name="probe-sampler", daemon=True).start()
