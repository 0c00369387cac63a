# Sourced by the scripts/h200_*.sh device calls: strict pipes, unbuffered Python, ple-um installed
# from the working tree (no index on the device), the device named in $OUT/device.txt.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { echo "pip failed"; cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
