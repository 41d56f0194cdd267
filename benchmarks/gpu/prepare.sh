#!/usr/bin/env bash
# On this (networked, GPU-less) machine: fetch the offline kit for the lent GPU machine and cut it
# into part folders that each fit one 64 MiB device call next to the checkout.
#   bash benchmarks/gpu/prepare.sh [KIT_DIR]     (KIT_DIR defaults to ../shared/offline-wheels)
# Result: gpu-parts/p1 ... pN (git-ignored); join-and-install.sh rides in the last one.
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=${1:-../shared/offline-wheels}
[ -d .gpu-wheels ] || bash "$kit/fetch.sh" .gpu-wheels
rm -rf gpu-parts
bash "$kit/split.sh" gpu-parts 56 .gpu-wheels/*
last=$(ls -d gpu-parts/p* | sort -V | tail -1)
cp "$kit/join-and-install.sh" "$last/"
ls -d gpu-parts/p* | sort -V | while read -r part; do echo "$part $(du -sm "$part" | cut -f1) MiB"; done
