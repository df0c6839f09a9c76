# Shared by the scripts that keep the original ReST-KV scripts' names and arguments (sourced, not run).
# PY: the python to run (default: scripts/lib/python.sh's choice); DEVICE=cpu: run on CPU even with a GPU;
# DRY_RUN=1: print each run's command line (shell-quoted) instead of running it.

source "$(dirname "${BASH_SOURCE[0]}")/python.sh"

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

# need_model EXAMPLE: refuse the placeholder model path (one line, before any work), naming an example model.
need_model() {
    if [[ -z "${MODEL_PATH:-}" || "$MODEL_PATH" == "<path_to_model>" ]]; then
        echo "$(basename "$0"): set MODEL_PATH, e.g. MODEL_PATH=$1 bash $0" >&2
        exit 2
    fi
}

# paper_knobs METHOD: the flags that give METHOD the knobs the original's runners ran it with, where restkv's
# defaults differ (printed one per line). ReST-KV: the paper's knobs (--preset paper: kernel 5, EMA with
# alpha 0.3, ...; restkv's default is kernel 7 and the mean); SnapKV, PyramidKV, AdaKV and HeadKV: pooling
# kernel 5 (the original's --kernel_sizes default; restkv's is 7). A flag the script or the user gives after
# them wins; the runner then prints one line naming each knob that is not the paper's.
paper_knobs() {
    case "${1,,}" in
        restkv) printf '%s\n' --preset paper ;;
        snapkv | pyramidkv | adakv | headkv) printf '%s\n' --kernel_size 5 ;;
    esac
}

# finish MESSAGE: the original's last line, or, under DRY_RUN=1, that nothing was run.
finish() {
    if [[ "${DRY_RUN:-}" == 1 ]]; then
        echo "DRY_RUN=1: the command lines above were printed, not run"
    else
        echo "$1"
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
