# Shared by the scripts that keep the original ReST-KV scripts' names and arguments (sourced, not run).
# PY: the python to run (default python3); DEVICE=cpu: run on CPU even with a GPU;
# DRY_RUN=1: print each run's command line (shell-quoted) instead of running it.

PY=${PY:-python3}

dry_run() {
    printf '%q ' python3 "$@"
    echo
}
[[ "${DRY_RUN:-}" == 1 ]] && PY=dry_run

has_cuda() {
    [[ "${DEVICE:-}" != cpu ]] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

# use_gpu ID: CUDA_VISIBLE_DEVICES=ID as the original, and DEVICE_FLAGS for the runner: the original's
# GPU settings (float16, flash_attention_2), or CPU ones with a one-line note when there is no CUDA device.
use_gpu() {
    export CUDA_VISIBLE_DEVICES=$1
    if has_cuda; then
        DEVICE_FLAGS=(--device cuda --dtype float16 --attn_implementation flash_attention_2)
    else
        echo "no CUDA device: GPU $1 not used; running on CPU (--device cpu --dtype float32" \
             "--attn_implementation sdpa)" >&2
        DEVICE_FLAGS=(--device cpu --dtype float32 --attn_implementation sdpa)
    fi
}

# need_model: refuse the placeholder model path (one line, before any work).
need_model() {
    if [[ -z "${MODEL_PATH:-}" || "$MODEL_PATH" == "<path_to_model>" ]]; then
        echo "$(basename "$0"): set MODEL_PATH, e.g. MODEL_PATH=meta-llama/Llama-3.1-8B-Instruct bash $0" >&2
        exit 2
    fi
}

# run_experiments RUNNER GPUS... -- : run "$RUNNER" once per line of EXPERIMENTS ("method capacity rest"),
# with run_one_flags building its flags; with CUDA one run per GPU at a time (as the original), on CPU one
# after another. Stops after the first group holding a failed run, with its exit status.
run_experiments() {
    local gpus=("$@") n idx=0 status=0 pids=() exp method capacity rest gpu
    has_cuda || gpus=("${gpus[0]}")
    n=${#gpus[@]}
    for exp in "${EXPERIMENTS[@]}"; do
        read -r method capacity rest <<< "$exp"
        gpu=${gpus[$((idx % n))]}
        use_gpu "$gpu"
        # shellcheck disable=SC2086  # rest: the experiment's flags, split as the original does
        run_one "$method" "$capacity" $rest &
        pids+=($!)
        idx=$((idx + 1))
        if (( idx % n == 0 || idx == ${#EXPERIMENTS[@]} )); then
            for pid in "${pids[@]}"; do
                wait "$pid" || status=$?
            done
            pids=()
            if (( status != 0 )); then
                echo "$(basename "$0"): a run failed (exit $status); stopped after it" >&2
                exit "$status"
            fi
        fi
    done
}
