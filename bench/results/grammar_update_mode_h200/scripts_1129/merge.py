"""Fold every JSONL under a folder into one file, each record tagged with its source file (the device returns at most 8 files)."""
import json, pathlib, sys
src, dst, tag = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
with dst.open("a") as out:
    for f in sorted(src.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                rec = json.loads(line); rec["_file"] = f"{tag}/{f.name}"
                out.write(json.dumps(rec) + "\n")
        f.unlink()
