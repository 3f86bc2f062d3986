#!/usr/bin/env bash
# Run on the machine of run10.sh right after it (as one command line): c32 alternated, default,
# hole (.cache/d/decoy/sitecustomize.py, DECOY=1), default; one engine each.
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg; DEC=/tmp/decoy; mkdir -p $DEC && cp .cache/d/decoy/sitecustomize.py $DEC/; export JSPEC_COMMIT=db87a9a; mkdir -p /tmp/res2; for v in default decoy default; do mkdir -p /tmp/res2/c32_$v$SECONDS; d=/tmp/res2/c32_$v$SECONDS; if [[ $v == decoy ]]; then pp=$DEC:$PWD:/tmp/llg; else pp=/tmp/llg; fi; echo "== $v $SECONDS"; DECOY=1 PYTHONPATH=$pp PROMPTS=32 ROUNDS=1 timeout $((320 - SECONDS)) bash bench/grammar_cost.sh $d alternate 2>&1 | grep -E "^constraint|rror"; (cd /tmp/res2 && tar cJf $OUT/res2.tar.xz .); done
