python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
date -u
timeout 100 python3 bench/decode.py --models qwen3-8b --no-hf --batches 1,8,64 --contexts 512,4096 > $OUT/d_new.md 2>&1; grep "^| qwen3-8b\|copy" $OUT/d_new.md | tail -7
timeout -s INT 250 python3 -m pytest -q -m gpu tests/executor/test_gpu_models.py -k "qwen3_hf_golden_bf16 or batch_1_decode or qwen3_5_hf_golden_bf16" -p no:cacheprovider 2>&1 | tail -4
