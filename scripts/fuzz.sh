#!/usr/bin/env bash
# Fuzz the collator and packer for SECONDS (default 300). cargo-fuzz needs
# nightly flags; RUSTC_BOOTSTRAP lets the stable toolchain accept them.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-300}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
RUSTC_BOOTSTRAP=1 cargo fuzz run collate -- -max_total_time="$seconds" -print_final_stats=1
