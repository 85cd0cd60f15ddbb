#!/usr/bin/env bash
# Run the project on aarch64 from an x86-64 Debian 12 machine: an arm64 Debian bookworm chroot under qemu's user-mode
# emulation, with a Python 3.11 virtual environment, PyPI's CPU build of torch for aarch64 and a clone of this
# repository's committed tree. Needs root and Debian's package mirror and PyPI; every step is skipped when its result
# is already there, so a second run takes about a minute.
#
#   sudo bash bench/aarch64_emulated.sh                               # set up (about 10 minutes the first time)
#   sudo bash bench/aarch64_emulated.sh 'python -m pytest -q tests/test_model_parity.py'   # then run in it
#
# A command runs in the clone (/root/mla in the chroot), refreshed to this repository's HEAD first. Emulation runs
# torch about 10-30x slower than the host: it shows that the aarch64 paths work, not how fast they are.
#
# torch: from 2.11 on, PyPI's aarch64 wheel of torch is a CUDA build (430 MB, with the CUDA toolkit's packages as
# dependencies); 2.10.0 is the newest CPU-only one, and is what this installs. triton: its 3.6 interpreter, torch
# 2.10's usual companion, fails under numpy 2.4 (the Triton kernel tests run interpreted), so the x86 environment's
# 3.9 is taken.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
R="${ARM64_ROOT:-/opt/arm64}"
TORCH="torch==2.10.0"
TRITON="triton==3.9.0"
export DEBIAN_FRONTEND=noninteractive

inside() {  # a command in the chroot, with the virtual environment first on PATH
  chroot "$R" /usr/bin/env -i PATH=/root/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LANG=C.UTF-8 TERM=dumb bash -c "$*"
}

# 1. qemu's static user-mode emulator, registered for aarch64 binaries with the F flag (the interpreter opened once,
#    so that it works inside the chroot); containers without systemd-binfmt need the registration by hand
dpkg -s qemu-user-static debootstrap >/dev/null 2>&1 || { apt-get update -q; apt-get install -y -q qemu-user-static debootstrap; }
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  echo ':qemu-aarch64:M::\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:F' \
    > /proc/sys/fs/binfmt_misc/register
fi

# 2. the arm64 root file system (debootstrap runs its second stage through the emulator), the host's mounts and DNS,
#    and its extra certificate authorities (a proxy that re-signs PyPI's certificates needs them inside too)
[ -x "$R/usr/bin/apt-get" ] || debootstrap --arch=arm64 --variant=minbase --include=ca-certificates bookworm "$R" \
  http://deb.debian.org/debian
mountpoint -q "$R/proc" || mount -t proc proc "$R/proc"
mountpoint -q "$R/sys" || { mount --rbind /sys "$R/sys"; mount --make-rslave "$R/sys"; }
mountpoint -q "$R/dev" || mount --bind /dev "$R/dev"
mountpoint -q "$R/dev/pts" || mount --bind /dev/pts "$R/dev/pts"
cp /etc/resolv.conf "$R/etc/resolv.conf"
cp /usr/local/share/ca-certificates/*.crt "$R/usr/local/share/ca-certificates/" 2>/dev/null || true
inside 'update-ca-certificates >/dev/null'

# 3. Python 3.11, a C++ compiler (the indexer's operator builds on aarch64), git; the virtual environment and torch
inside 'dpkg -s python3-venv python3-dev g++ git curl >/dev/null 2>&1 || { apt-get update -q &&
  apt-get install -y -q --no-install-recommends python3 python3-venv python3-dev python3-pip gcc g++ git curl procps; }'
inside '[ -x /root/venv/bin/python ] || python3 -m venv /root/venv'
inside "python -c 'import torch' 2>/dev/null || pip install -q $TORCH"

# 4. this repository's committed tree at HEAD, installed editable with the test extra
[ -d "$R/root/mla/.git" ] || git clone -q "$ROOT" "$R/root/mla"
git -C "$R/root/mla" fetch -q "$ROOT" HEAD && git -C "$R/root/mla" reset -q --hard FETCH_HEAD
inside "cd /root/mla && pip install -q -e '.[test]' $TORCH $TRITON"
inside 'python -c "import platform, torch; print(platform.machine(), \"torch\", torch.__version__)"'

if [ $# -gt 0 ]; then
  inside "cd /root/mla && $*"
fi
