"""Per command-buffer cache (XLA's primary-graph LRU): hits, misses, evictions and the command
count of its graph, from a TF_CPP_VMODULE=command_buffer_thunk=3 log."""
import collections, re, sys, json
hit = re.compile(r"Command buffer cache hit; cache=(\w+)")
miss = re.compile(r"Command buffer cache miss \((empty slot|LRU replacement)\); cache=(\w+).*updated_alloc_indices=\[([\d,]*)\]")
upd = re.compile(r"Create/Update command buffer.*num_commands=(\d+); updated_allocs=(\d+)")
caches = collections.defaultdict(lambda: {"hits": 0, "misses": 0, "evictions": 0, "commands": None, "moved": collections.Counter()})
last = None
for line in open(sys.argv[1], errors="replace"):
    if m := hit.search(line):
        caches[m.group(1)]["hits"] += 1; last = m.group(1)
    elif m := miss.search(line):
        c = caches[m.group(2)]; c["misses"] += 1; c["evictions"] += m.group(1) == "LRU replacement"
        c["moved"][m.group(3)] += 1; last = m.group(2)
    elif (m := upd.search(line)) and last:
        caches[last]["commands"] = int(m.group(1))
out = {k: {**v, "moved": dict(v["moved"].most_common(8))} for k, v in caches.items() if v["hits"] + v["misses"] > 3}
json.dump(out, open(sys.argv[2], "w"), indent=1)
for k, v in sorted(out.items(), key=lambda kv: -(kv[1]["hits"] + kv[1]["misses"])):
    print(k, v["commands"], "hits", v["hits"], "misses", v["misses"], "evictions", v["evictions"], v["moved"])
