#!/bin/bash
# The files BRANCH adds or changes since it left the checkout's history, written under DIR (default .ab) at
# their paths: the "b" side of `python -m benchmarks ab --ab-dir DIR --ab-stages ...` (carry DIR). A file
# the checkout also changed since then is refused (the copy would undo that change: rebase the branch first).
# Usage: bash benchmarks/ab_files.sh BRANCH [DIR]
set -eu
branch=${1:?usage: bash benchmarks/ab_files.sh BRANCH [DIR]}
dir=${2:-.ab}
base=$(git merge-base HEAD "$branch")
both=$(comm -12 <(git diff --name-only "$base" HEAD | sort) <(git diff --name-only "$base" "$branch" | sort))
[ -z "$both" ] || { printf 'changed on both sides since %s (rebase %s):\n%s\n' "$base" "$branch" "$both" >&2; exit 1; }
rm -rf "$dir" && mkdir "$dir"
git diff --name-only --diff-filter=AM "$base" "$branch" | while read -r path; do
    mkdir -p "$dir/$(dirname "$path")"
    git show "$branch:$path" >"$dir/$path"
done
find "$dir" -type f | sed 's/^/  /'
