#!/usr/bin/env bash
# Regenerate the evidence the docs cite, reproducibly: from a clean clone at one commit, run the campaigns, verify
# each sealed bundle against that commit, copy it to docs/evidence/<campaign>/, re-render docs/validation.md from
# every bundle there and rewrite the generated figures blocks of README.md and docs/*.md.
#
#   scripts/regenerate_evidence.sh [--commit SHA] [--keep DIR] CAMPAIGN...     (make evidence CAMPAIGNS="...")
#
# The checkout it is run in must be clean and at SHA (default: its HEAD): the files it writes there are the only
# change, so committing them gives a commit whose sole difference from SHA is its own evidence (see "Reading
# committed evidence" in docs/evidence/README.md: such a bundle is one commit behind by construction).
#
# Environment: PYTHON (an interpreter with gemscout's dependencies and the qualify extra; default .venv/bin/python),
# MAIN_REF (the ref that is main, for freshness; default main), JOBS (cells at once; default 1), MAX_BUNDLE_BYTES
# (a bundle bigger than this is not copied into docs/; default 2 MiB or 96 KiB per cell, whichever is more: what
# tests/unit/test_doc_figures.py allows).
#
# Exit: 0 done; 1 a campaign failed or a bundle did not verify (nothing is copied for it, the docs are not touched);
# 2 usage (dirty checkout, HEAD is not SHA, unknown campaign, bundle too large).
set -euo pipefail

usage() { echo "usage: scripts/regenerate_evidence.sh [--commit SHA] [--keep DIR] CAMPAIGN..." >&2; exit 2; }
die() { echo "regenerate_evidence: $1" >&2; exit "${2:-1}"; }

SRC=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
SHA=""
KEEP=""
CAMPAIGNS=()
while (($#)); do
  case "$1" in
    --commit) SHA=${2:-}; [[ -n $SHA ]] || usage; shift 2 ;;
    --keep) KEEP=${2:-}; [[ -n $KEEP ]] || usage; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    -*) usage ;;
    *) CAMPAIGNS+=("$1"); shift ;;
  esac
done
((${#CAMPAIGNS[@]})) || usage
PYTHON=${PYTHON:-$SRC/.venv/bin/python}
MAIN_REF=${MAIN_REF:-main}
JOBS=${JOBS:-1}
MAX_BUNDLE_BYTES=${MAX_BUNDLE_BYTES:-}
[[ -x $PYTHON ]] || die "PYTHON=$PYTHON is not an interpreter (make setup, or set PYTHON)" 2
# Absolute: the campaigns run from inside the clone, where a relative path names nothing.
PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")

HEAD=$(git -C "$SRC" rev-parse HEAD)
SHA=$(git -C "$SRC" rev-parse --verify "${SHA:-HEAD}^{commit}") || die "--commit $SHA is not a commit here" 2
[[ $SHA == "$HEAD" ]] || die "the checkout is at ${HEAD:0:12}, not ${SHA:0:12}: check out $SHA first, so the \
evidence is committed directly on top of the commit it ran at" 2
[[ -z $(git -C "$SRC" status --porcelain --untracked-files=normal) ]] \
  || die "the checkout has uncommitted changes: commit or stash them (the docs written here must differ from \
${SHA:0:12} by the evidence alone)" 2
for c in "${CAMPAIGNS[@]}"; do
  [[ -f $SRC/campaigns/$c.toml ]] || die "unknown campaign $c: no campaigns/$c.toml" 2
done

WORK=${KEEP:-$(mktemp -d "${TMPDIR:-/tmp}/gemscout-evidence.XXXXXX")}
mkdir -p "$WORK"
[[ -n $KEEP ]] || trap 'rm -rf "$WORK"' EXIT
CLONE=$WORK/clone
rm -rf "$CLONE" "$WORK/runs"
echo "== clean clone of ${SHA:0:12} in $CLONE"
git clone -q --no-hardlinks "$SRC" "$CLONE"
git -C "$CLONE" checkout -q --detach "$SHA"
# The clone's code, not an installed copy: rank programs inherit PYTHONPATH.
export PYTHONPATH="$CLONE/src:$CLONE"
where=$(cd "$CLONE" && "$PYTHON" -c 'import gemscout, qualification; print(gemscout.__file__, qualification.__file__)')
for f in $where; do [[ $f == "$CLONE"/* ]] || die "$f is imported instead of the clone's code (PYTHONPATH)" 2; done

for c in "${CAMPAIGNS[@]}"; do
  out=$WORK/runs/$c
  echo "== qualify run $c (at ${SHA:0:12})"
  (cd "$CLONE" && "$PYTHON" -m qualification run "$c" --out "$out" --jobs "$JOBS" --no-report) \
    || die "campaign $c did not pass (its run is in $out with --keep); nothing copied, docs untouched"
  echo "== verify $c against ${SHA:0:12}"
  # Freshness is judged in the source checkout against MAIN_REF. Valid + bound to SHA is what is required here:
  # 0 (CURRENT), 3 (STALE: main moved on) and 6 (not on main yet: a branch) are valid bundles of this commit.
  rc=0
  (cd "$SRC" && "$PYTHON" -m qualification verify "$out" --expected-commit "$SHA" --main-ref "$MAIN_REF" \
    --require-complete) || rc=$?
  [[ $rc == 0 || $rc == 3 || $rc == 6 ]] || die "bundle $c did not verify against ${SHA:0:12} (exit $rc)"
  # The bytes of its files, as tests/unit/test_doc_figures.py counts them (du -sb would add every folder's
  # entry size, which is not part of the bundle).
  bytes=$(find "$out" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
  # A bundle is a few JSON files per cell: the allowance grows with the campaign (topologies has over 100 cells).
  cells=$(find "$out/cells" -mindepth 1 -maxdepth 1 -type d | wc -l)
  limit=${MAX_BUNDLE_BYTES:-$((cells * 98304 > 2097152 ? cells * 98304 : 2097152))}
  ((bytes <= limit)) || die "bundle $c is $bytes bytes, over its limit of $limit (MAX_BUNDLE_BYTES): \
docs/ holds small bundles only (every file is part of what verify checks, so none can be dropped)" 2
  if find "$out" -type f \( -name '*.gsc' -o -name '*.pt' -o -name '*.pth' -o -name '*.distcp' -o -name '*.bin' \
      -o -name '*.safetensors' -o -name '*.npy' \) | grep -q .; then
    die "bundle $c holds checkpoint files; it cannot go into docs/" 2
  fi
done

for c in "${CAMPAIGNS[@]}"; do
  rm -rf "$SRC/docs/evidence/$c"
  mkdir -p "$SRC/docs/evidence"
  cp -R "$WORK/runs/$c" "$SRC/docs/evidence/$c"
  rc=0
  (cd "$SRC" && "$PYTHON" -m qualification verify "docs/evidence/$c" --expected-commit "$SHA" --main-ref "$MAIN_REF" \
    >/dev/null) || rc=$?
  [[ $rc == 0 || $rc == 3 || $rc == 6 ]] || die "the copy docs/evidence/$c does not verify (exit $rc)"
  echo "== docs/evidence/$c: $(du -sh "$SRC/docs/evidence/$c" | cut -f1), $(find "$SRC/docs/evidence/$c" -type f | wc -l) files"
done

echo "== docs/validation.md from every bundle under docs/evidence/"
bundles=()
for m in "$SRC"/docs/evidence/*/manifest.json; do bundles+=("$(dirname "$m")"); done
(cd "$SRC" && "$PYTHON" scripts/render_validation_doc.py "${bundles[@]}" --expected-commit "$SHA" \
  --main-ref "$MAIN_REF" --out docs/validation.md)
echo "== generated figures blocks"
pages=()
for p in "$SRC/README.md" "$SRC"/docs/*.md; do
  [[ $p == */validation.md ]] || ! grep -q '^<!-- BEGIN GENERATED figures ' "$p" || pages+=("$p")
done
if ((${#pages[@]})); then
  (cd "$SRC" && "$PYTHON" scripts/render_validation_doc.py --update-blocks "${pages[@]}" --main-ref "$MAIN_REF")
else
  echo "(no page has a generated block)"
fi
echo
echo "Evidence for ${SHA:0:12} written. Commit it on its own, on top of ${SHA:0:12}:"
echo "  git add docs/evidence docs/validation.md README.md docs/*.md"
echo "  git commit -m 'evidence: ${CAMPAIGNS[*]} at ${SHA:0:12}'"
