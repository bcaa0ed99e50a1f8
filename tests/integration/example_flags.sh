#!/bin/sh
# examples/gpt_text and examples/fashion_mnist_cnn given bad flags: each case must exit non-zero
# with an "error:" line naming the problem, quickly (before any training: no "step " line), and
# never crash (no signal, no "terminate called"). A summary whose write fails (file size limit)
# must leave neither the summary nor its temporary file behind.
# usage: example_flags.sh GPT_TEXT FASHION_MNIST_CNN
set -u
gpt=$1
cnn=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/empty" "$tmp/ro"
failures=0

# expect_error NAME EXPECTED_TEXT PROGRAM ARGS...
expect_error() {
  name=$1 text=$2
  shift 2
  timeout 60 "$@" >"$tmp/out" 2>&1
  rc=$?
  if [ "$rc" -eq 0 ] || [ "$rc" -ge 124 ]; then
    echo "FAIL $name: exit status $rc (want a clean error)"; failures=$((failures + 1))
  elif ! grep -q "^error: .*$text" "$tmp/out"; then
    echo "FAIL $name: no 'error: ...$text' line"; failures=$((failures + 1))
  elif grep -q "^step \|^epoch \|terminate called" "$tmp/out"; then
    echo "FAIL $name: trained or crashed before the error"; failures=$((failures + 1))
  else
    echo "ok   $name: $(grep '^error:' "$tmp/out" | head -1)"
    return 0
  fi
  sed 's/^/     | /' "$tmp/out" | tail -5
}

# ---- gpt_text ----
expect_error gpt-unknown-flag '"--bogus"' "$gpt" --bogus 1
expect_error gpt-steps-0 'steps' "$gpt" --steps 0
expect_error gpt-steps-negative 'steps' "$gpt" --steps -3
expect_error gpt-steps-no-value 'needs a value' "$gpt" --steps
expect_error gpt-steps-huge 'steps' "$gpt" --steps 1e300
expect_error gpt-steps-2^63 'steps' "$gpt" --steps 9223372036854775808
expect_error gpt-steps-times-batch 'windows' "$gpt" --steps 4611686018427387904 --batch-size 4
expect_error gpt-too-many-windows 'windows' "$gpt" --steps 2000000000000000000 --batch-size 4
expect_error gpt-batch-0 'batch-size' "$gpt" --batch-size 0
expect_error gpt-threads-huge 'threads' "$gpt" --threads 99999999999
expect_error gpt-lr-inf 'lr' "$gpt" --lr inf
expect_error gpt-lr-nan 'lr' "$gpt" --lr nan
expect_error gpt-sample-negative 'sample' "$gpt" --sample -1 --steps 100000
expect_error gpt-precision 'precision' "$gpt" --precision fp64
expect_error gpt-missing-corpus '/nonexistent/corpus' "$gpt" --corpus /nonexistent/corpus
expect_error gpt-empty-corpus "$tmp/empty" "$gpt" --corpus "$tmp/empty"
expect_error gpt-summary-missing-dir '/nonexistent/dir/s.json' "$gpt" --steps 100000 --summary-json /nonexistent/dir/s.json
expect_error gpt-summary-is-dir 'is a directory' "$gpt" --steps 100000 --summary-json "$tmp/empty"
if [ "$(id -u)" -ne 0 ]; then  # root writes anywhere
  chmod 500 "$tmp/ro"
  expect_error gpt-summary-readonly "$tmp/ro/s.json" "$gpt" --steps 100000 --summary-json "$tmp/ro/s.json"
fi
# The write itself fails (RLIMIT_FSIZE 0, SIGXFSZ ignored so write() returns EFBIG): an error,
# and no half-written summary or stray temporary file.
# (Output through a pipe: a file written under the limit would fail too.)
out=$(trap '' XFSZ; ulimit -f 0; "$gpt" --steps 1 --context 16 --summary-json "$tmp/s.json" 2>&1; echo "exit=$?")
printf '%s\n' "$out" >"$tmp/out"
rc=$(printf '%s\n' "$out" | sed -n 's/^exit=//p')
if [ "$rc" -eq 0 ] || [ "$rc" -ge 124 ] || [ -e "$tmp/s.json" ] || [ -e "$tmp/s.json.tmp" ] || ! grep -q "^error: .*s.json" "$tmp/out"; then
  echo "FAIL gpt-summary-write-fails: exit $rc, files: $(ls "$tmp")"; sed 's/^/     | /' "$tmp/out" | tail -5
  failures=$((failures + 1))
else
  echo "ok   gpt-summary-write-fails: $(grep '^error:' "$tmp/out" | head -1)"
fi

# ---- fashion_mnist_cnn ----
expect_error cnn-unknown-flag '"--steps"' "$cnn" --steps 3
expect_error cnn-epochs-0 'epochs' "$cnn" --epochs 0
expect_error cnn-batch-0 'batch-size' "$cnn" --batch-size 0
expect_error cnn-batch-too-big 'batch-size' "$cnn" --batch-size 99999999999999
expect_error cnn-normalize-2 'normalize' "$cnn" --normalize 2
expect_error cnn-update-bn-negative 'update-bn' "$cnn" --update-bn -1
expect_error cnn-threads-huge 'threads' "$cnn" --threads 99999999999
expect_error cnn-lr-nan 'lr' "$cnn" --lr nan
expect_error cnn-weight-decay-negative 'weight-decay' "$cnn" --weight-decay -1
expect_error cnn-missing-data '/nonexistent/data' "$cnn" --data-dir /nonexistent/data
expect_error cnn-empty-data "$tmp/empty" "$cnn" --data-dir "$tmp/empty"
expect_error cnn-summary-missing-dir '/nonexistent/dir/s.json' "$cnn" --summary-json /nonexistent/dir/s.json

echo "$failures failure(s)"
[ "$failures" -eq 0 ]
