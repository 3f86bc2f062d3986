# HEAD (4407c2c: flat bigram keys, vectorised next_ids) on one c32 process: the prompt steps' planning and packing in the ramp.
set -u
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
export PYTHONPATH=/tmp/llg
mkdir -p $OUT/r
PHASES=1 ROUNDS=1 PROMPTS=32 timeout 170 bash bench/grammar_cost.sh $OUT/r alternate > $OUT/r/run.log 2>&1
echo "rc $?" >> $OUT/progress.txt
python3 bench/alternate_summary.py $OUT/r > $OUT/summary.txt 2>&1
python3 .cache/d/xsteps.py $OUT/r/host_phases_c32.json > $OUT/xsteps.txt 2>&1
python3 .cache/d/run_phases.py $OUT/r/host_phases_c32.json >> $OUT/xsteps.txt 2>&1
cp $OUT/r/host_phases_c32.txt $OUT/phases.txt; rm -f $OUT/r/host_phases_c32.json
