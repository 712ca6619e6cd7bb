#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo-fuzz, libFuzzer) of the request-body parser,
# the Prometheus text parser, the policy compiler and the ext_proc session.
# See fuzz/README.md.
#
#   bash fuzz/run.sh smoke          build every target, run each for
#                                   FUZZ_SMOKE_SECONDS (20) from its seeds and
#                                   regressions; fails on any crash (CI)
#   bash fuzz/run.sh long [SECS]    run each target for SECS (600) seconds,
#                                   growing fuzz/corpus/<target>
#   bash fuzz/run.sh build          build only
#
# Installs cargo-fuzz (pinned) under ${KINFERENCE_CACHE:-$HOME/.cache/kinference}.
# Runs on a stable toolchain: cargo-fuzz passes nightly-only flags, which
# RUSTC_BOOTSTRAP=1 lets stable accept. Crashes land in fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")"

mode="${1:-smoke}"
targets=(request_body prom_text policy_compile extproc_session)

cache="${KINFERENCE_CACHE:-$HOME/.cache/kinference}"
fuzz_root="$cache/cargo-fuzz"
cargo_fuzz_version="0.13.2"
export PATH="$fuzz_root/bin:$HOME/.cargo/bin:$PATH"
export RUSTC_BOOTSTRAP=1

# CI clones afresh each run: the build lives in the cache the script owns,
# so the next run (any checkout, CI or not) is warm.
target_dir="${KINFERENCE_FUZZ_TARGET_DIR:-$cache/fuzz-target}"

# No sanitizer: the workspace forbids unsafe code, and ASan would halve the
# executions. Debug assertions and overflow checks stay on (cargo-fuzz's
# default without -O).
build_opts=(--sanitizer none --debug-assertions --target-dir "$target_dir")
# -timeout: one input taking longer is a hang; -rss_limit_mb: a leak or a
# runaway allocation.
fuzz_opts=(-timeout=10 -rss_limit_mb=2048 -print_final_stats=1)

# -max_len per target: the Prometheus parser works line by line, so a few
# KiB of text (the seeds are the heads of real pages) cover it at several
# times the executions a long page allows.
max_len() {
  case "$1" in
    prom_text) echo 4096 ;;
    *) echo 16384 ;;
  esac
}

install_cargo_fuzz() {
  if [[ "$("$fuzz_root/bin/cargo-fuzz" --version 2>/dev/null || true)" != "cargo-fuzz $cargo_fuzz_version" ]]; then
    echo "installing cargo-fuzz $cargo_fuzz_version into $fuzz_root"
    cargo install cargo-fuzz --locked --version "$cargo_fuzz_version" --root "$fuzz_root"
  fi
}

build() {
  local start
  start=$(date +%s)
  cargo fuzz build "${build_opts[@]}"
  echo "built ${targets[*]} ($(( $(date +%s) - start ))s)"
}

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The reproducers of regressions/TARGET, less the known failures listed in
# regressions/known-failures.txt (all of them with KINFERENCE_FUZZ_STRICT=1),
# copied into a directory whose path is printed.
regressions() {
  local target="$1" dir="$work/regressions-$1" f
  mkdir -p "$dir"
  for f in "regressions/$target"/*; do
    [[ -f "$f" ]] || continue
    if [[ "${KINFERENCE_FUZZ_STRICT:-}" != 1 ]] &&
      grep -qE "^$target/$(basename "$f")([[:space:]]|\$)" regressions/known-failures.txt 2>/dev/null; then
      echo "$target: skipping known failure $f" >&2
      continue
    fi
    cp "$f" "$dir/"
  done
  echo "$dir"
}

# run TARGET SECONDS CORPUS_DIR: fuzz TARGET for SECONDS, new inputs going to
# CORPUS_DIR, seeds and regressions read as well. Prints one summary line.
run() {
  local target="$1" seconds="$2" corpus="$3" log status=0
  log="$work/$target.log"
  mkdir -p "$corpus" "artifacts/$target"
  local dirs=("$corpus" "seeds/$target" "$(regressions "$target")")
  cargo fuzz run "${build_opts[@]}" "$target" "${dirs[@]}" -- \
    "${fuzz_opts[@]}" -max_len="$(max_len "$target")" -max_total_time="$seconds" \
    >"$log" 2>&1 || status=$?
  local execs cov
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
  cov="$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 || true)"
  if [[ $status -eq 0 ]]; then
    echo "$target: ok, ${execs:-?} executions in ${seconds}s, ${cov:-cov: ?}, corpus $(find "$corpus" -type f | wc -l) inputs"
  else
    echo "$target: FAILED (exit $status)"
    grep -A2 -m1 'panicked at' "$log" || true
    echo "the last lines of its log:"
    tail -n 60 "$log"
    echo "reproduce: RUSTC_BOOTSTRAP=1 cargo fuzz run ${build_opts[*]} $target fuzz/artifacts/$target/<file>"
  fi
  return "$status"
}

case "$mode" in
  build)
    install_cargo_fuzz
    build
    ;;
  smoke)
    install_cargo_fuzz
    build
    seconds="${FUZZ_SMOKE_SECONDS:-20}"
    passed=0 failed=0
    for t in "${targets[@]}"; do
      if run "$t" "$seconds" "$work/corpus-$t"; then
        passed=$((passed + 1))
      else
        failed=$((failed + 1))
      fi
    done
    echo "fuzz: $passed passed, $failed failed"
    [[ $failed -eq 0 ]]
    ;;
  long)
    install_cargo_fuzz
    build
    seconds="${2:-600}"
    status=0
    for t in "${targets[@]}"; do
      run "$t" "$seconds" "corpus/$t" || status=1
    done
    exit "$status"
    ;;
  *)
    echo "usage: $0 smoke | long [seconds] | build" >&2
    exit 2
    ;;
esac
