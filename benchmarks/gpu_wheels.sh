# Sourced by the GPU scripts (gpu_check.sh, gpu_profile.sh) from the project root: puts the
# carried wheels of $GPU_CHECK_WHEELS (default .whl, and the unpacked packages of its -extra/site
# beside it, both written by benchmarks/gpu_fetch_wheels.sh) into a temporary site on PYTHONPATH
# before the project, or, with none carried, the project alone (the installed packages are used).
# $1 names the calling script in its log line; $python is the interpreter.
gpu_wheels() {
  local wheels=${GPU_CHECK_WHEELS:-.whl} site
  if compgen -G "$wheels/*.whl" >/dev/null; then
    site=$(mktemp -d)
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
      "$wheels"/*.whl
    if [ -d "$wheels-extra/site" ]; then cp -r "$wheels-extra/site"/. "$site"/; fi
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "[$1] installed $(ls "$wheels"/*.whl | wc -l) wheels into $site"
  else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "[$1] no wheels in $wheels: using the installed packages"
  fi
}
