python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
timeout 120 python3 .gpu/regs.py 2>&1 | grep "regs\|Error" | cut -c1-300
timeout 200 python3 bench/launch_sweep.py --no-gemv > $OUT/sweep.md 2> $OUT/sweep.err; grep "^attention\|Error" $OUT/sweep.err | tail -10; grep -i "copy band" $OUT/sweep.md | cut -c1-60
