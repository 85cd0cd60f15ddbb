# Sourced by bench/gpu_check.sh and bench/cpu_proof.sh: each check's steps run under a time limit, their output kept
# in $LOG/<name>.txt and a row of $LOG/status.md each (a Markdown table the report copies). Set CHECK (the name the
# progress lines begin with) before sourcing.
LOG=$(mktemp -d)
echo "| step | exit | time |" >"$LOG/status.md"
echo "|---|---:|---:|" >>"$LOG/status.md"

step() {  # step NAME SECONDS COMMAND...: run it under a limit, keep its output, record its status
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$LOG/$name.txt" 2>&1
    local rc=$?
    echo "| $name | $rc | $((SECONDS - t0)) s |" >>"$LOG/status.md"
    echo "$CHECK: $name: exit $rc in $((SECONDS - t0)) s"
}

skip() {  # skip NAME WHY: a step not run, and why
    echo "| $1 | not run | $2 |" >>"$LOG/status.md"
    echo "$CHECK: $1: not run: $2"
}
