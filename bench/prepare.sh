# Sourced by the bench scripts: installs the load tools from Debian's packages when
# missing and builds the release binary.
missing=()
command -v wrk >/dev/null || missing+=(wrk)
command -v nginx >/dev/null || missing+=(nginx-light)
# The plot uses Debian's Python and its matplotlib, whatever python3 is first on PATH.
/usr/bin/python3 -c 'import matplotlib' 2>/dev/null || missing+=(python3-matplotlib)
if ((${#missing[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
cargo build --release --quiet
