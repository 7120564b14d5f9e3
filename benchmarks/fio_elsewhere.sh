#!/usr/bin/env bash
# Run bench_probe_fio.py on a machine that has no fio package and cannot reach a registry (the
# lent GPU machine: 16 cores, quiet, unlike the shared 2-core VM where cold figures swing 2x).
#
#   here:   bash benchmarks/fio_elsewhere.sh pack        # writes .fio.tar.xz (fio + its shared
#                                                        # libraries + this host's ld.so, ~23 MB)
#   there:  bash benchmarks/fio_elsewhere.sh run [ARGS]  # unpacks it into a temp dir, puts a
#                                                        # `fio` wrapper first on PATH, runs
#                                                        # bench_probe_fio.py ARGS
#
# The wrapper starts the packed fio through the packed dynamic loader with only the packed
# libraries, so the target's own glibc version does not matter. The same steps, typed inline,
# produced
# benchmarks/results/probe_fio-h100.json (feedpipe importable through PYTHONPATH there):
#   bash benchmarks/fio_elsewhere.sh run --passes 3 --duration 5 --name probe_fio-h100
set -euo pipefail
case "${1:-}" in
pack)
    dir=$(mktemp -d)
    mkdir -p "$dir/fiopack/lib"
    cp -L "$(command -v fio)" "$dir/fiopack/"
    ldd "$(command -v fio)" | awk '/=>/ {print $3}' | xargs -I{} cp -L {} "$dir/fiopack/lib/"
    cp -L /lib64/ld-linux-x86-64.so.2 "$dir/fiopack/lib/"
    tar cJf .fio.tar.xz -C "$dir" fiopack
    rm -rf "$dir"
    ls -l .fio.tar.xz
    ;;
run)
    shift
    dest=$(mktemp -d -t feedpipe-fio.XXXXXX)
    trap 'rm -rf "$dest"' EXIT
    mkdir -p "$dest/bin"
    tar xJf .fio.tar.xz -C "$dest"
    printf '#!/bin/sh\nexec %s/fiopack/lib/ld-linux-x86-64.so.2 --library-path %s/fiopack/lib %s/fiopack/fio "$@"\n' \
        "$dest" "$dest" "$dest" > "$dest/bin/fio"
    chmod +x "$dest/bin/fio"
    export PATH="$dest/bin:$PATH"
    fio --version
    python3 benchmarks/bench_probe_fio.py "$@"
    ;;
*)
    echo "usage: $0 pack | run [bench_probe_fio.py arguments]" >&2
    exit 2
    ;;
esac
