# Sourced by the one-call GPU scripts (session_gpu.sh): with R (the output folder),
# PY and LIMIT (seconds for the whole call) set and SECONDS=0 at the start, `run NAME BUDGET_S
# COMMAND...` runs the command under a timeout of the time left, output to $R/NAME.txt, if BUDGET_S
# is left and NAME is not in SKIP; steps.txt gets each step's exit status and time.
# `machine_info` writes the GPU, the cores, the commit and the versions to $R/machine.txt.
step() { echo "$1 rc=$2 t=${SECONDS}s" >>"$R/steps.txt"; }
run() {
    local name=$1 budget=$2
    shift 2
    case " ${SKIP:-} " in *" $name "*) echo "$name skipped: SKIP" >>"$R/steps.txt"; return ;; esac
    local left=$(( LIMIT - SECONDS ))
    if [ "$left" -lt "$budget" ]; then
        echo "$name skipped: ${left}s left, needs ${budget}s" >>"$R/steps.txt"
        return
    fi
    timeout "$left" "$@" >"$R/$name.txt" 2>&1
    step "$name" $?
}
machine_info() {
    {
        nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
        nproc
        git log --oneline -1 2>/dev/null
        "$PY" -c "import sys, numpy, torch, torchvision, PIL; print(sys.version.split()[0], numpy.__version__, torch.__version__, torchvision.__version__, PIL.__version__)"
    } >"$R/machine.txt" 2>&1
}
