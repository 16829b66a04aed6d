#!/usr/bin/env bash
# Prepares, on this machine, what benchmarks/device/run.sh needs carried to a borrowed TPU machine:
#   .whl-tpu/      the wheels that machine lacks (it has jax, jaxlib, numpy, scipy, ml_dtypes, opt_einsum, pytest):
#                  the versions requirements.txt pins, the versions the CPU tests run with for their dependencies;
#                  tensorstore (a ~20 MB binary) is not carried, run.sh installs it from that machine's own index
#   .device-data/  Tiny Shakespeare's input.txt, and MNIST as train.py's decoded cache (compressed npz) plus TFDS's
#                  dataset_info.json (train.py then reads the cache and never imports tensorflow_datasets)
# and lists both folders (and device_out/, run.sh's output folder when run here) in .git/info/exclude.
# Idempotent: a second run downloads and decodes nothing. Prints the wheels and the total size to carry.
#
#   bash benchmarks/device/prepare.sh           # SHARED=folder overrides ../shared (data/, tensorflow_datasets/)
#
# Needs the network (pip download; antlr4-python3-runtime has no wheel on PyPI, so it is built here) and, for
# MNIST, this machine's requirements.txt environment (tensorflow_datasets decodes the array_record files once).
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/../.."
WHL=.whl-tpu
DATA=.device-data
SHARED=${SHARED:-../shared}

# requirements.txt's pin of $1 (the name as written there)
req() { sed -n "s/^$1==\([^ #]*\).*/\1/p" requirements.txt; }
WANT=(
  # what train.py and the benchmarks import: Hydra, the models, optimizers, checkpoints, the progress bar
  "hydra-core==$(req hydra-core)" "omegaconf==$(req omegaconf)" "antlr4-python3-runtime==4.9.3" PyYAML==6.0.3
  "flax==$(req flax)" "optax==$(req optax)" "orbax-checkpoint==$(req orbax-checkpoint)" "tqdm==$(req tqdm)"
  # Hydra imports every module of hydra_plugins/ at start; hydra_plugins/dp_scaling_launchers imports these
  "hydra-submitit-launcher==$(req hydra-submitit-launcher)" "submitit==$(req submitit)" cloudpickle==2.1.0
  # the runtime dependencies flax, optax and orbax-checkpoint declare (tensorstore: run.sh)
  absl-py==2.5.1 etils==1.15.0 fsspec==2026.9.0 zipp==4.1.2 typing-extensions==4.16.0 msgpack==1.2.4 rich==15.0.0
  markdown-it-py==4.3.0 mdurl==0.1.2 treescope==0.1.10 humanize==4.17.0 protobuf==7.36.2 psutil==7.2.2
  simplejson==4.3.0 aiofiles==25.1.0 prometheus-client==0.26.0 uvloop==0.23.0
)
# Not carried: chex (no module imports it), wandb (W&B is disabled there: no sockets), tensorflow-datasets,
# array-record, pillow, importlib-resources (MNIST travels decoded), matplotlib, grain, the development tools.
PLATFORM=(--only-binary=:all: --python-version 3.11 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux1_x86_64)

# ---- wheels: one version of each; the list in $WHL/.wanted says which set the folder holds
wanted=$(printf '%s\n' "${WANT[@]}")
whls=("$WHL"/*.whl)
if [ "$(cat "$WHL/.wanted" 2>/dev/null)" != "$wanted" ] || [ ${#whls[@]} != ${#WANT[@]} ]; then
  rm -rf "$WHL" && mkdir -p "$WHL"
  for spec in "${WANT[@]}"; do
    if [ "${spec%%==*}" = antlr4-python3-runtime ]; then  # sdist only: build the (pure-Python) wheel
      python3 -m pip wheel -q --no-deps --no-binary=:all: -w "$WHL" "$spec"
    else
      python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$WHL" "$spec"
    fi
  done
  whls=("$WHL"/*.whl)
  [ ${#whls[@]} = ${#WANT[@]} ] || { echo "error: ${#whls[@]} wheels in $WHL, not ${#WANT[@]}" >&2; exit 1; }
  printf '%s\n' "$wanted" > "$WHL/.wanted"
fi

# ---- data
mkdir -p "$DATA/tiny_shakespeare"
if [ ! -s "$DATA/tiny_shakespeare/input.txt" ]; then
  install -m 644 "$SHARED/data/tiny_shakespeare/input.txt" "$DATA/tiny_shakespeare/input.txt"
fi
echo "6fb458f1232090904fb40fe944165e91  $DATA/tiny_shakespeare/input.txt" | md5sum -c --quiet
TFDS=$SHARED/tensorflow_datasets
if [ ! -s "$DATA/mnist-3.0.1-test.npz" ] || [ ! -s "$DATA/mnist-3.0.1-train.npz" ]; then
  # decoded with the repository's own reader (the arrays train.py caches), then stored compressed
  if ! python3 - "$TFDS" "$DATA" <<'EOF'
import os, sys, tempfile
import numpy as np
sys.path.insert(0, ".")
from data.sources import load_tfds_split
tfds_dir, out = sys.argv[1:]
with tempfile.TemporaryDirectory() as tmp:
    for split in ("train", "test"):
        d = load_tfds_split("mnist", split, tfds_dir, tmp, download=False)
        np.savez_compressed(f"{out}/mnist.tmp.npz", images=d.images, labels=d.labels)
        os.replace(f"{out}/mnist.tmp.npz", f"{out}/mnist-3.0.1-{split}.npz")
        print(f"mnist {split}: {d.images.shape} {d.images.dtype}, {d.labels.shape} {d.labels.dtype}")
EOF
  then
    rm -f "$DATA"/mnist*.npz
    echo "note: no MNIST from $TFDS/mnist/3.0.1 (see above); not carried: data=mnist will not run there" >&2
  fi
fi
if [ -s "$DATA/mnist-3.0.1-train.npz" ] && [ ! -f "$DATA/tensorflow_datasets/mnist/3.0.1/dataset_info.json" ]; then
  # train.py takes the data's version from the TFDS folder's dataset_info.json (data/sources.py: prepared_version)
  install -D -m 644 -t "$DATA/tensorflow_datasets/mnist/3.0.1" "$TFDS"/mnist/3.0.1/{dataset_info,features}.json
fi

# ---- both folders ignored by git (not in .gitignore: they are this checkout's own)
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" && touch "$exclude"
for d in "/$WHL/" "/$DATA/" /device_out/; do  # device_out/: run.sh's output folder when run here
  grep -qxF "$d" "$exclude" || echo "$d" >> "$exclude"
done

printf '%s\n' "${whls[@]#"$WHL"/}"
du -sh "$WHL" "$DATA"
tree_kib=$(git ls-files -co --exclude-standard -z | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "carried in all: $(( (tree_kib + $(du -sk "$WHL" | cut -f1) + $(du -sk "$DATA" | cut -f1)) / 1024 )) MiB" \
  "(the working tree ${tree_kib} KiB + $WHL + $DATA; the limit is 64 MiB)"
