#!/usr/bin/env bash
# kvcache-tool hash-token writes what a tenants file holds for a token: the
# SHA-256 of its bytes in lowercase hex, as `printf %s TOKEN | sha256sum`
# does; from a file or standard input, surrounding whitespace removed; an
# empty token is an error.
# Usage: hash_token_test.sh PATH/TO/kvcache-tool
set -euo pipefail
tool=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
want=$(printf %s "s3cret-token" | sha256sum | cut -d' ' -f1)
printf 's3cret-token\n' >"$work/token"
from_file=$("$tool" hash-token --token-file "$work/token")
from_stdin=$(printf '  s3cret-token \n' | "$tool" hash-token)
[[ $from_file == "$want" ]] || { echo "from a file: $from_file, want $want"; exit 1; }
[[ $from_stdin == "$want" ]] || { echo "from stdin: $from_stdin, want $want"; exit 1; }
if printf '\n' | "$tool" hash-token 2>/dev/null; then
  echo "an empty token was hashed"; exit 1
fi
echo "hash-token: ok ($want)"
