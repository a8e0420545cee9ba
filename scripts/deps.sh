#!/usr/bin/env bash
# Install the Debian packages kvtier needs to build and test. Idempotent: runs apt-get only when
# something is missing. The CUDA toolkit is optional and is not installed here (/usr/local/cuda).
set -euo pipefail
pkgs=(build-essential clang cmake pkg-config libjemalloc-dev libcriterion-dev libjansson-dev zlib1g-dev liblapacke-dev libopenblas-dev python3 python3-venv)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "deps: ok"
