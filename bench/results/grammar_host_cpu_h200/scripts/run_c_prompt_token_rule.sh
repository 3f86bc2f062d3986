# A constrained request decodes once its prompt token is read (N, the working tree) against HEAD (O:
# the tree with HEAD's scheduler / request), alternated process by
# process on one machine: c32 constrained (host phases), then c1.
set -u
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
export PYTHONPATH=/tmp/llg
rm -rf /tmp/old && mkdir /tmp/old && cp -r . /tmp/old/ && cp .cache/d/old/scheduler.py .cache/d/old/request.py /tmp/old/jspec/runtime/
here=$PWD
start=$SECONDS
run() {  # side dir out [env...]
  local side=$1 o=$2; shift 2
  mkdir -p $o
  (cd $([ $side = N ] && echo $here || echo /tmp/old) && env "$@" timeout 240 bash bench/grammar_cost.sh $o alternate > $o/run.log 2>&1)
  echo "$o rc $? at $((SECONDS-start)) s" >> $OUT/progress.txt
}
for p in 1 2; do
  for s in N O; do
    (( SECONDS - start > 300 )) && break 2
    run $s $OUT/r/c32/$s/p$p PHASES=1 ROUNDS=1 PROMPTS=32
  done
done
for s in N O; do
  (( SECONDS - start > 420 )) && break
  run $s $OUT/r/c1/$s/p1 CONCURRENCY=1 PROMPTS=4 ROUNDS=2
done
python3 bench/alternate_summary.py $OUT/r/c32/N $OUT/r/c32/O $OUT/r/c1/N $OUT/r/c1/O > $OUT/summary.txt 2>&1
for f in $OUT/r/c32/*/p*/host_phases_c32.txt; do echo "== $f"; cat $f; done > $OUT/phases.txt
cd $OUT && tar cJf r.tar.xz r && rm -rf r
