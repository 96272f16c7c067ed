# Sourced by the device scripts (benchmarks/gpu_session6*.sh): the NVLS-off settings, the carried wheels in a private
# site dir (.whl, see the device README) and $OUT. Run from the repository root.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
OUT="${OUT:-$PWD/bench-out}"
mkdir -p "$OUT"
