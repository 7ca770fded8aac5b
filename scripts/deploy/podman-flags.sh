# Sourced by scripts/deploy/build-image and scripts/deploy/run-image: the flags podman needs on hosts like the
# development machine, as the arrays RUNTIME and ULIMITS.

# crun refuses hybrid cgroup layouts (cgroup v1 with a v2 mount), which runc runs on.
RUNTIME=()
if command -v runc >/dev/null; then RUNTIME=(--runtime "$(command -v runc)"); fi

# podman's default ulimits are above what a process without CAP_SYS_RESOURCE may set, so ask
# for limits the host allows: this shell's open files, and its processes capped at the kernel's
# pid_max (conmon, which starts the runtime, runs with no more than that on the development
# machine, and a limit above its own cannot be set).
limit() { local n; n=$("ulimit" "$1"); [ "$n" = unlimited ] && n=1048576; echo "$n"; }
NOFILE=$(limit -Sn)
NPROC=$(limit -Su)
PID_MAX=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 32768)
[ "$NPROC" -gt "$PID_MAX" ] && NPROC=$PID_MAX
ULIMITS=(--ulimit "nofile=$NOFILE:$NOFILE" --ulimit "nproc=$NPROC:$NPROC")
