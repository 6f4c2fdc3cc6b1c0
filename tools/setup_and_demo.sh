#!/usr/bin/env bash
# Set up from nothing (tools/common.sh) and run the demo; arguments go to `python -m attnres demo`.
#   tools/setup_and_demo.sh
#   ATTNRES_NO_VENV=1 tools/setup_and_demo.sh   # the GPU machine (offline, preinstalled deps)
# The package is built in build/package, the build tools/setup_and_test.sh uses: after one of the two, the
# other compiles no kernel again. No system package is needed beyond the README's prerequisites (ninja comes
# from the venv), so no apt and no sudo.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

setup
timed demo "$PYTHON" -m attnres demo "$@"
