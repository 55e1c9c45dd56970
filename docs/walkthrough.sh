#!/usr/bin/env bash
# Prints the terminal walk-through of docs/store.md: every command is run for real, here.
# Usage: bash docs/walkthrough.sh [BASE]   (BASE defaults to /tmp/demo and is recreated)
set -u
BASE=${1:-/tmp/demo}
REPO=$(cd "$(dirname "$0")/.." && pwd)
export PATH="$REPO/.venv/bin:$PATH"
if [ -e "$BASE" ]; then chmod -R u+w "$BASE" && rm -rf "$BASE"; fi
mkdir -p "$BASE/datasets/train" "$BASE/datasets/val"
cd "$BASE" || exit 1

# Show a command, run it, show its output and, when not 0, its exit code.
show() {
    printf '$ %s\n' "$*"
    bash -c "$*" 2>&1
    local code=$?
    if [ "$code" -ne 0 ]; then printf '[exit %d]\n' "$code"; fi
    printf '\n'
}

export SAEV_SCRATCH=$BASE/scratch SAEV_NFS=$BASE/nfs SAEV_STAGE_ROOT=$BASE/local
printf '$ export SAEV_SCRATCH=%s SAEV_NFS=%s SAEV_STAGE_ROOT=%s\n\n' "$SAEV_SCRATCH" "$SAEV_NFS" "$SAEV_STAGE_ROOT"

cat > write_caches.py <<'EOF'
# Two small ViT-S/16-shaped caches (train and val) written with ShardWriter.
import os
import numpy as np
import saev_shards as ss

root = os.path.expandvars("$SAEV_SCRATCH/saev/shards")
for split, n in (("train", 256), ("val", 64)):
    md = ss.Metadata(family="clip", ckpt="ViT-S-16/synthetic", layers=(6, 11), patches_per_ex=196,
                     cls_token=True, d_model=384, n_examples=n, patches_per_shard=60_000,
                     data={"name": "synthetic", "split": split}, dataset=os.path.abspath(f"datasets/{split}"))
    rng = np.random.default_rng(0)
    with ss.ShardWriter(root, md, stats=True) as w:
        for start in range(0, n, 32):
            w.write(rng.standard_normal((32, *md.shape[1:]), dtype=np.float32),
                    labels=rng.integers(0, 10, (32, 196), dtype=np.uint8))
    print(split, md.hash)
EOF
show python write_caches.py
TRAIN=$(ls "$SAEV_SCRATCH/saev/shards" | while read -r h; do grep -q '"train"' "$SAEV_SCRATCH/saev/shards/$h/metadata.json" && echo "$h"; done)
VAL=$(ls "$SAEV_SCRATCH/saev/shards" | while read -r h; do grep -q '"val"' "$SAEV_SCRATCH/saev/shards/$h/metadata.json" && echo "$h"; done)
T=${TRAIN:0:4}
V=${VAL:0:4}

show saev-shards ls
show saev-shards info "$T"
show saev-shards verify "$T"
show saev-shards resolve "$V"
show saev-shards stage "$T"
show saev-shards run init --train "$T" --val "$V" --id sae-16k
show saev-shards doctor --run sae-16k
show "python -c 'import saev_shards as ss; print(ss.open(\"$T\"))'"

# A scratch purge deletes a shard behind our back.
show "chmod u+w $SAEV_SCRATCH/saev/shards/$TRAIN && rm $SAEV_SCRATCH/saev/shards/$TRAIN/acts000001.bin"
show saev-shards verify "$T"
show saev-shards ls
show saev-shards doctor --run sae-16k
show saev-shards info beef

# Clean-up: a cache a run links to is refused; what is stale is listed with sizes and ages.
show saev-shards rm "$T" --yes
show saev-shards clean --dry-run
