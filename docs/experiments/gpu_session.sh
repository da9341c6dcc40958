#!/usr/bin/env bash
# Every GPU check of docs/experiments/plan.md ("On a GPU") in one command, for a machine lent for minutes.
#
# Usage, from the repository root on a machine with one CUDA GPU, its python3 holding torch:
#   bash docs/experiments/gpu_session.sh OUT_DIR [SUITE_SECONDS]
# Wheels of what that python lacks (mnist1d, optuna and its needs) may sit in .whl/: they are
# installed into /tmp/site first. bunsan itself is installed editable, without dependencies.
# Writes OUT_DIR/log.txt (everything, in order), gpu_check.json, codec_calls.json,
# codec_calls_rotated.json, codec_calibration.json, plan_resnet20_b128.json and suite.txt
# (the whole suite, on as many pytest processes as the machine has cores / 4, one test file to each at a time, cut at
# SUITE_SECONDS, default 300). The exit status is the number of failed steps.
set -u
out=${1:?OUT_DIR}
suite_s=${2:-300}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
failed=0
step() {  # step NAME COMMAND...: run, log, count a failure
    local name=$1
    shift
    echo "== $name: $*" | tee -a "$out/log.txt"
    local start=$SECONDS
    "$@" 2>&1 | tee -a "$out/log.txt"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc in $((SECONDS - start)) s" | tee -a "$out/log.txt"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step env bash -c 'nvidia-smi -L; nproc; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), torch.cuda.get_device_name())"; git log -1 --format=%h 2>/dev/null || true'
step gpu_check python3 docs/experiments/gpu_check.py --json "$out/gpu_check.json"
step pytest_gpu python3 -m pytest -q -m gpu -p no:cacheprovider tests
step codec_calls python3 docs/experiments/gpu_codec_calls.py --json "$out/codec_calls.json"
step codec_calls_rotated python3 docs/experiments/gpu_codec_calls.py --bits 1 --rotate --json "$out/codec_calls_rotated.json"
step codec_calibration python3 docs/experiments/gpu_codec_calibration.py --rounds 3 --json "$out/codec_calibration.json"
step plan python3 -m bunsan plan --model resnet20 --device cuda --batch 128 --workers 8,32,256 --link 25gbit \
    --latency 10us --png /tmp/plan.png --json "$out/plan_resnet20_b128.json"
workers=$(($(nproc) / 4))
[ "$workers" -ge 1 ] || workers=1
xdist=()
python3 -c "import xdist" 2>/dev/null && [ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist loadfile)
echo "== suite: ${xdist[*]:-one process}, cut at $suite_s s" | tee -a "$out/log.txt"
timeout -k 10 "$suite_s" python3 -m pytest -p no:cacheprovider -rfE -o console_output_style=classic "${xdist[@]}" tests \
    >"$out/suite.txt" 2>&1
rc=$?
tail -25 "$out/suite.txt" | tee -a "$out/log.txt"
echo "== suite: exit $rc" | tee -a "$out/log.txt"
exit "$failed"
