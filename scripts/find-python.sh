#!/usr/bin/env bash
# Print the path of an interpreter for one of the given Python versions, the
# first one found: pythonX.Y on PATH, then pyenv's installs. The path printed
# is the interpreter itself (sys.executable), never a pyenv shim, and it has
# answered with the version asked for. Fails when none is found.
#
#   scripts/find-python.sh 3.14 3.13      # the newest of the two that is here
set -euo pipefail

# The interpreter's own path if "$1" runs and is Python "$2"; nothing otherwise.
probe() {
    "$1" -c 'import sys
if "%d.%d" % sys.version_info[:2] == sys.argv[1]:
    print(sys.executable)' "$2" 2>/dev/null || true
}

for wanted in "$@"; do
    candidates=()
    if command -v "python$wanted" >/dev/null 2>&1; then
        candidates+=("$(command -v "python$wanted")")
    fi
    if command -v pyenv >/dev/null 2>&1 && root="$(pyenv root 2>/dev/null)"; then
        for version in $(pyenv versions --bare 2>/dev/null | sort -rV); do
            case "$version" in
                "$wanted" | "$wanted".*) candidates+=("$root/versions/$version/bin/python$wanted") ;;
            esac
        done
    fi
    for candidate in ${candidates[@]+"${candidates[@]}"}; do
        found="$(probe "$candidate" "$wanted")"
        if [ -n "$found" ]; then
            echo "$found"
            exit 0
        fi
    done
done
echo "No Python $* interpreter found (looked on PATH and in pyenv)." >&2
exit 1
