python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
date -u
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_decode_attention_mma.py tests/kernels/test_decode_attention.py 2>&1 | tail -2
timeout 150 python3 bench/launch_sweep.py --no-gemv > $OUT/sweep.md 2> $OUT/sweep.err; grep "^attention\|Error" $OUT/sweep.err | tail -10; grep -i "copy band" $OUT/sweep.md | cut -c1-60
timeout 60 python3 bench/kernels.py --no-scalar --kernels decode_attention > $OUT/k_new.md 2>&1; grep -i "decode attention\|copy" $OUT/k_new.md | tail -2
timeout 100 python3 bench/decode.py --models qwen3-8b --no-hf --batches 1,64 --contexts 512,4096 > $OUT/d_new.md 2>&1; grep "^| qwen3-8b" $OUT/d_new.md | tail -4
(cd .gpu/base && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 bench/decode.py --models qwen3-8b --no-hf --batches 1,64 --contexts 512,4096 > $OUT/d_base.md 2>&1; grep "^| qwen3-8b" $OUT/d_base.md | tail -4)
timeout 200 python3 -m pytest -q -m gpu tests/executor/test_gpu_models.py -k "golden and not float32" 2>&1 | tail -2
timeout 120 python3 -m pytest -q -m gpu tests/executor/test_decode_graphs.py -k "qwen3-0.6b" 2>&1 | tail -2
