# Throwaway probe: the bucket of each constrained split step and whether its arena was new, run-length encoded at exit.
import atexit, os
if os.environ.get("ARENA_LOG"):
    from jspec.runtime import static_carry
    seq = []
    orig = static_carry.ArenaKeeper.take
    def take(self, owner, make):
        made = []
        def m():
            made.append(1)
            return make()
        a = orig(self, owner, m)
        seq.append(f"{owner.bucket.label}{'*' if made else ''}")
        return a
    static_carry.ArenaKeeper.take = take
    @atexit.register
    def dump():
        if not seq:
            return
        runs = []
        for s in seq:
            if runs and runs[-1][0] == s:
                runs[-1][1] += 1
            else:
                runs.append([s, 1])
        with open(os.environ["ARENA_LOG"], "a") as f:
            f.write(f"pid {os.getpid()} steps {len(seq)} new {sum(s.endswith('*') for s in seq)}\n")
            f.write(" ".join(f"{s}x{n}" for s, n in runs) + "\n")
