#!/usr/bin/env bash
# TransformerEngine 2.20.2 on the GPU machine, assembled from what the device calls carry (issue 7).
# It downloads nothing: ../shared/gpu/te_chunks.sh .te prepares .te/ here (wheels, core.part0..4,
# the torch-extension source), and the machine is held warm between the calls of one session.
#   bash benchmarks/te_device.sh stage N        # call N (0..4), carry [".te/core.partN"] (+ the small files
#                                               #   with part 4, the smallest: 64 MiB per call in all)
#   bash benchmarks/te_device.sh build [CPUS]   # after part 4: install the wheels, start the extension build
#   bash benchmarks/te_device.sh install        # the wheels only (with unpack instead of build)
#   bash benchmarks/te_device.sh wait [SECS]    # until the build ends (exit 0) or SECS pass (exit 3)
#   bash benchmarks/te_device.sh merge          # put the built extension beside the Python package
#   bash benchmarks/te_device.sh pack DIR       # the built extension in <=15 MiB parts, to bring back
#   bash benchmarks/te_device.sh unpack DIR     # a later machine: install, unpack packed parts, merge
# Then: export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
TE=/tmp/te
SITE=/tmp/site
WHEEL=transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
cmd=${1:?usage: te_device.sh stage N|install|build|wait|merge|pack DIR|unpack DIR}
mkdir -p "$TE" "$SITE"
case "$cmd" in
  stage)
    n=${2:?part number}
    cp ".te/core.part$n" "$TE/"
    # the small files (wheels, extension source) ride along with whichever part has room: copy any here
    for f in .te/*.whl .te/*.tar.gz; do if [ -e "$f" ]; then cp "$f" "$TE/"; fi; done
    ls -la "$TE" ;;
  install)
    cat "$TE"/core.part* > "$TE/$WHEEL"
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$TE"/*.whl ;;
  build)
    cpus=${2:-0-$(( $(nproc) - 1 ))}
    bash "$0" install
    mkdir -p "$TE/src" && tar xzf "$TE/transformer_engine_torch-2.20.2-src.tar.gz" -C "$TE/src"
    jobs=$(taskset -c "$cpus" nproc)
    # setsid: the build must outlive this call; its exit status lands in the log for `wait`
    ( cd "$TE/src" && PYTHONPATH="$SITE" NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=$jobs NVTE_CUDA_ARCHS=90 \
        CUDA_HOME=/usr/local/cuda setsid nohup taskset -c "$cpus" bash -c \
        'python3 -m pip install --no-index --no-deps --no-build-isolation --target '"$TE"'/ext . ; echo "BUILD_EXIT=$?"' \
        > "$TE/build.log" 2>&1 & )
    echo "build started on cpus $cpus ($jobs jobs)" ;;
  wait)
    limit=${2:-500}; t=0
    until grep -q '^BUILD_EXIT=' "$TE/build.log" 2>/dev/null; do
      [ "$t" -ge "$limit" ] && { echo "build still running after ${limit}s"; tail -3 "$TE/build.log"; exit 3; }
      sleep 10; t=$((t + 10))
    done
    tail -5 "$TE/build.log"
    grep -q '^BUILD_EXIT=0' "$TE/build.log" ;;
  merge)
    cp -r "$TE"/ext/transformer_engine/* "$SITE/transformer_engine/"
    cp -r "$TE"/ext/*.dist-info "$SITE/"
    PYTHONPATH="$SITE" python3 -c 'import transformer_engine.pytorch as te; print("transformer_engine", te.__version__ if hasattr(te, "__version__") else "ok")' ;;
  pack)
    dir=${2:?target dir}; mkdir -p "$dir"
    tar czf - -C "$TE" ext | split -b 15m -d -a 1 - "$dir/te-ext.tgz.part"
    ls -la "$dir" ;;
  unpack)
    dir=${2:?dir with te-ext.tgz.part*}
    bash "$0" install
    cat "$dir"/te-ext.tgz.part* | tar xzf - -C "$TE"
    bash "$0" merge ;;
  *) echo "unknown command $cmd"; exit 2 ;;
esac
