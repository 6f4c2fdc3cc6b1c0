#!/usr/bin/env bash
# Set up from nothing (tools/common.sh) and run the demo; arguments go to `python -m attnres demo`.
#   tools/setup_and_demo.sh
#   ATTNRES_NO_VENV=1 tools/setup_and_demo.sh   # the GPU machine (offline, preinstalled deps)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

setup ninja-build
timed demo "$PYTHON" -m attnres demo "$@"
