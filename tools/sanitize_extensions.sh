#!/usr/bin/env bash
# The three C extensions (feedpipe/_native/: _jpegcrop.c, _packrows.c, _stagefiles.c) built with
# AddressSanitizer and UndefinedBehaviorSanitizer into a temporary copy of the package, then the
# differential fuzz (tests/test_native_fuzz.py, FEEDPIPE_FUZZ_EXAMPLES examples a test: 40
# unless set) and tests/test_jpegcrop.py's truncated, corrupt and mangled-bytes tests run against
# those builds. Any sanitizer report fails the run, as does a failing test or an extension that
# did not build.
#
#     bash tools/sanitize_extensions.sh        (from a checkout, its Python environment active)
#
# Needs gcc with its sanitizer runtimes (Debian: libasan8 and libubsan1, installed with gcc;
# where they are missing this tries apt, best effort as .ci/run does for nginx) and
# libjpeg-turbo's headers. Python itself is not sanitized: libasan is preloaded, and
# PYTHONMALLOC=malloc puts Python's own buffers (decode_crop's bytearray) under ASan's watch.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
CC=${CC:-gcc}

runtime() { # the path of gcc's runtime library $1 (e.g. libasan.so), or nothing
  local p
  p=$("$CC" -print-file-name="$1" 2>/dev/null || true)
  if [ -n "$p" ] && [ "$p" != "$1" ] && [ -e "$p" ]; then
    readlink -f "$p"
  fi
}

if [ -z "$(runtime libasan.so)" ] || [ -z "$(runtime libubsan.so)" ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; fi
    major=$("$CC" -dumpversion | cut -d. -f1)
    ( export DEBIAN_FRONTEND=noninteractive; $SUDO apt-get update -qq \
      && $SUDO apt-get install -y -qq "libgcc-$major-dev" >/dev/null ) \
      || echo "sanitize: libgcc-$major-dev (libasan, libubsan) did not install (apt offline or refused)"
  fi
fi
ASAN=$(runtime libasan.so)
if [ -z "$ASAN" ] || [ -z "$(runtime libubsan.so)" ]; then
  echo "sanitize: SKIPPED: $CC has no AddressSanitizer/UBSan runtime here (libasan.so," \
       "libubsan.so); the extensions were not checked" >&2
  exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/feedpipe-sanitize-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir "$WORK/tree"
cp -R "$SRC/feedpipe" "$SRC/tests" "$SRC/setup.py" "$SRC/pyproject.toml" "$WORK/tree/"
find "$WORK/tree" \( -name '*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +

echo "== sanitize: building the extensions with -fsanitize=address,undefined ($ASAN)"
FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
( cd "$WORK/tree" && CC="$CC" CFLAGS="$FLAGS" LDFLAGS="-fsanitize=address,undefined" \
    "$PY" setup.py -q build_ext --inplace >"$WORK/build.log" 2>&1 ) || {
  cat "$WORK/build.log" >&2
  exit 1
}
for ext in _jpegcrop _packrows _stagefiles; do
  so=$(ls "$WORK/tree/feedpipe/_native/$ext".*.so 2>/dev/null || true)
  # setup.py's extensions are optional: a failed build is only a warning there, an error here
  if [ -z "$so" ] || ! nm -D "$so" | grep -q __asan_; then
    cat "$WORK/build.log" >&2
    echo "sanitize: feedpipe._native.$ext did not build with AddressSanitizer" >&2
    exit 1
  fi
done

echo "== sanitize: the fuzz and the hostile-bytes tests against those builds"
mkdir "$WORK/reports"
status=0
( cd "$WORK/tree" \
  && PYTHONPATH="$WORK/tree" PYTHONMALLOC=malloc LD_PRELOAD="$ASAN" \
     FEEDPIPE_FUZZ_EXAMPLES="${FEEDPIPE_FUZZ_EXAMPLES:-40}" \
     ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:alloc_dealloc_mismatch=0:detect_odr_violation=0:log_path=$WORK/reports/asan" \
     UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
     "$PY" -c 'import sys, feedpipe._native._jpegcrop as j, feedpipe._native._packrows as p, feedpipe._native._stagefiles as s
for m in (j, p, s):  # the sanitized builds, not an installed copy
    assert m.__file__.startswith(sys.argv[1]), m.__file__' "$WORK/tree/" \
  && PYTHONPATH="$WORK/tree" PYTHONMALLOC=malloc LD_PRELOAD="$ASAN" \
     FEEDPIPE_FUZZ_EXAMPLES="${FEEDPIPE_FUZZ_EXAMPLES:-40}" \
     ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:alloc_dealloc_mismatch=0:detect_odr_violation=0:log_path=$WORK/reports/asan" \
     UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
     "$PY" -m pytest -q -s -p no:cacheprovider -k "short or mangled or truncated or corrupt" \
       tests/test_native_fuzz.py tests/test_jpegcrop.py ) 2>&1 | tee "$WORK/tests.log" \
  || status=$?
# (-s: UBSan writes its reports to stderr whatever log_path says, and pytest would swallow
# them with the output of the test the process died in)
if compgen -G "$WORK/reports/*" >/dev/null \
    || grep -Eq "runtime error:|ERROR: (Address|UndefinedBehavior)Sanitizer" "$WORK/tests.log"; then
  if compgen -G "$WORK/reports/*" >/dev/null; then cat "$WORK"/reports/* >&2; fi
  echo "sanitize: FAILED: the sanitizers reported the errors above" >&2
  exit 1
fi
if [ "$status" -ne 0 ]; then
  echo "sanitize: FAILED: the tests failed (exit status $status) under the sanitized builds" >&2
  exit "$status"
fi
echo "sanitize: no sanitizer report"
